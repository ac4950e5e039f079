"""Wait (at most 60 s) until the SeaweedFS started by scripts/test.sh with
S3 port PORT serves requests, has created BUCKET and takes writes: the S3
endpoint answers (anonymous requests get 403), the filer (PORT + 2) lists the
bucket, and an object written through the filer reads back (a write needs a
volume the master has assigned, which can lag the bucket)."""
import sys
import time
import urllib.error
import urllib.request

port, bucket = int(sys.argv[1]), sys.argv[2]


def status(url: str, method: str = "GET", data: bytes | None = None) -> int:
    try:
        req = urllib.request.Request(url, data=data, method=method)
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def writes() -> bool:
    probe = f"http://127.0.0.1:{port + 2}/buckets/{bucket}/.write-probe"
    if status(probe, "PUT", b"probe") not in (200, 201):
        return False
    ok = status(probe) == 200
    status(probe, "DELETE")
    return ok


deadline = time.time() + 60
last = "nothing answered"
while time.time() < deadline:
    if status(f"http://127.0.0.1:{port}/{bucket}") not in (200, 401, 403):
        last = "the S3 endpoint does not answer"
    elif status(f"http://127.0.0.1:{port + 2}/buckets/{bucket}/") != 200:
        last = f"the bucket {bucket} is not there"
    elif not writes():
        last = f"a write into {bucket} fails"
    else:
        sys.exit(0)
    time.sleep(0.2)
sys.exit(f"the S3 server is not ready after 60 s: {last}")
