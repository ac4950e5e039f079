"""A minimal Confluent-compatible schema registry for the Avro tests.

No Confluent-compatible registry installs from a package registry these
tests may use (Confluent's and Apicurio's are Maven/Docker artifacts,
Aiven's Karapace is not on PyPI), so the tests run this stand-in for the
REST endpoints producers and lakestream call. It keeps schemas in memory
as they were registered (a Protobuf schema as the base64
FileDescriptorProto the Python serializer registers, which is also what
the registry answers `?format=serialized` with), checks no compatibility,
and answers in the registry's own JSON shapes and error codes:

  POST /subjects/{subject}/versions     {"schema", "schemaType"?, "references"?} -> {"id"}
  POST /subjects/{subject}              {"schema", "schemaType"?} -> the version holding it
  GET  /schemas/ids/{id}                -> {"schema", "schemaType"?, "references"?}
  GET  /subjects/{subject}/versions/latest | /versions/{n}
                                        -> {"subject", "version", "id", "schema", "references"?}
  GET  /subjects                        -> [subject, ...]

usage: registry.py [--user USER:PASSWORD] [--cert CERT --key KEY]
Prints the port it listens on (127.0.0.1, a free port), then serves
until killed. With --user every request must carry that HTTP basic
authentication (401 otherwise); with --cert/--key it serves HTTPS.
Every request is logged to stderr as one JSON line.
"""
import base64
import json
import re
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LOCK = threading.Lock()
SCHEMAS = {}  # id -> {"schema": str, "schemaType": str}
SUBJECTS = {}  # subject -> [id, ...] (version n is index n-1)
AUTH = None

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, status, code, message):
        self.answer(status, {"error_code": code, "message": message})

    def authorized(self):
        if AUTH is None:
            return True
        want = "Basic " + base64.b64encode(AUTH.encode()).decode()
        if self.headers.get("Authorization") == want:
            return True
        self.error(401, 401, "Unauthorized")
        return False

    def log_request_line(self):
        sys.stderr.write(json.dumps({"method": self.command, "path": self.path}) + "\n")
        sys.stderr.flush()

    def do_GET(self):
        self.log_request_line()
        if not self.authorized():
            return
        path = unquote(urlparse(self.path).path)
        with LOCK:
            m = re.fullmatch(r"/schemas/ids/(\d+)", path)
            if m:
                s = SCHEMAS.get(int(m.group(1)))
                if s is None:
                    return self.error(404, 40403, f"Schema {m.group(1)} not found")
                body = {"schema": s["schema"]}
                if s["schemaType"] != "AVRO":
                    body["schemaType"] = s["schemaType"]
                if s["references"]:
                    body["references"] = s["references"]
                return self.answer(200, body)
            if path == "/subjects":
                return self.answer(200, sorted(SUBJECTS))
            m = re.fullmatch(r"/subjects/(.+)/versions/(latest|-1|\d+)", path)
            if m:
                ids = SUBJECTS.get(m.group(1))
                if not ids:
                    return self.error(404, 40401, f"Subject '{m.group(1)}' not found.")
                n = len(ids) if m.group(2) in ("latest", "-1") else int(m.group(2))
                if not 1 <= n <= len(ids):
                    return self.error(404, 40402, f"Version {n} not found.")
                s = SCHEMAS[ids[n - 1]]
                body = {
                    "subject": m.group(1),
                    "version": n,
                    "id": ids[n - 1],
                    "schema": s["schema"],
                    "schemaType": s["schemaType"],
                }
                if s["references"]:
                    body["references"] = s["references"]
                return self.answer(200, body)
        self.error(404, 404, "HTTP 404 Not Found")

    def do_POST(self):
        self.log_request_line()
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if not self.authorized():
            return
        path = unquote(urlparse(self.path).path)
        req = json.loads(raw or b"{}")
        m = re.fullmatch(r"/subjects/(.+)/versions", path)
        if not m:
            lookup = re.fullmatch(r"/subjects/(.+)", path)
            if lookup:
                return self.lookup(lookup.group(1), req)
            return self.error(404, 404, "HTTP 404 Not Found")
        schema = req.get("schema")
        if not isinstance(schema, str):
            return self.error(422, 42201, "Invalid schema")
        kind = req.get("schemaType", "AVRO")
        with LOCK:
            found = [i for i, s in SCHEMAS.items() if s["schema"] == schema and s["schemaType"] == kind]
            sid = found[0] if found else len(SCHEMAS) + 1
            SCHEMAS[sid] = {"schema": schema, "schemaType": kind, "references": req.get("references") or []}
            versions = SUBJECTS.setdefault(m.group(1), [])
            if sid not in versions:
                versions.append(sid)
        self.answer(200, {"id": sid})


    def lookup(self, subject, req):
        """POST /subjects/{subject}: the version of `subject` holding the
        schema of the request, if any."""
        kind = req.get("schemaType", "AVRO")
        with LOCK:
            for n, sid in enumerate(SUBJECTS.get(subject, []), start=1):
                s = SCHEMAS[sid]
                if s["schema"] == req.get("schema") and s["schemaType"] == kind:
                    return self.answer(
                        200,
                        {"subject": subject, "version": n, "id": sid, "schema": s["schema"], "schemaType": kind},
                    )
        if subject not in SUBJECTS:
            return self.error(404, 40401, f"Subject '{subject}' not found.")
        return self.error(404, 40403, "Schema not found")


def main() -> None:
    global AUTH
    args = sys.argv[1:]
    cert = key = None
    while args:
        flag, value, args = args[0], args[1], args[2:]
        if flag == "--user":
            AUTH = value
        elif flag == "--cert":
            cert = value
        elif flag == "--key":
            key = value
        else:
            sys.exit(f"unknown flag {flag}")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
