"""Wait (at most 60 s) until the SeaweedFS started by scripts/test.sh with
S3 port PORT serves requests and has created BUCKET: the S3 endpoint answers
(anonymous requests get 403) and the filer (PORT + 2) lists the bucket."""
import sys
import time
import urllib.error
import urllib.request

port, bucket = int(sys.argv[1]), sys.argv[2]


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


deadline = time.time() + 60
while time.time() < deadline:
    s3_up = status(f"http://127.0.0.1:{port}/{bucket}") in (200, 401, 403)
    bucket_made = status(f"http://127.0.0.1:{port + 2}/buckets/{bucket}/") == 200
    if s3_up and bucket_made:
        sys.exit(0)
    time.sleep(0.2)
sys.exit("S3 server did not answer in 60 s")
