"""Print a port P such that P..P+4 and P+10000..P+10004 are free on 127.0.0.1
(SeaweedFS serves HTTP on the first five and gRPC on the second five). P is
below 22700 so P+10000 stays under Linux's ephemeral range (32768+), where
outgoing connections could take a port between this check and the bind."""
import random
import socket
import sys


def free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


for _ in range(200):
    base = random.randrange(20000, 22700, 10)
    ports = [base + i for i in range(5)] + [base + 10000 + i for i in range(5)]
    if all(free(p) for p in ports):
        print(base)
        sys.exit(0)
sys.exit("no free block of ports found")
