"""An OAuth 2.0 token endpoint on 127.0.0.1 for the Kafka OAUTHBEARER/OIDC
test: answers every POST with a fresh unsigned JWT and appends what the
client sent (path, Authorization header, form body) to a log as JSON lines.

usage: token_server.py LOG_FILE

Prints the port it listens on, then serves until killed.
"""
import base64
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (the http.server name)
        length = int(self.headers.get("Content-Length", 0))
        body = self.rfile.read(length).decode()
        with open(sys.argv[1], "a") as log:
            log.write(
                json.dumps(
                    {
                        "path": self.path,
                        "authorization": self.headers.get("Authorization"),
                        "body": body,
                    }
                )
                + "\n"
            )
        now = int(time.time())
        claims = {"sub": "lakestream", "iat": now, "exp": now + 3600}
        token = ".".join(
            [b64(b'{"alg":"none","typ":"JWT"}'), b64(json.dumps(claims).encode()), "sig"]
        )
        answer = json.dumps(
            {"access_token": token, "token_type": "bearer", "expires_in": 3600}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def main() -> None:
    server = HTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
