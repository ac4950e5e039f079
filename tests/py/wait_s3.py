"""Wait (at most 60 s) until the S3 server at URL answers for BUCKET."""
import sys
import time
import urllib.error
import urllib.request

url, bucket = sys.argv[1], sys.argv[2]
deadline = time.time() + 60
while time.time() < deadline:
    try:
        urllib.request.urlopen(f"{url}/{bucket}", timeout=2)
        sys.exit(0)
    except urllib.error.HTTPError as e:
        # Anonymous requests are refused (403) once the server is up; a
        # missing bucket (404) or a 5xx means it is still starting.
        if e.code in (401, 403):
            sys.exit(0)
    except (urllib.error.URLError, OSError):
        pass
    time.sleep(0.2)
sys.exit("S3 server did not answer in 60 s")
