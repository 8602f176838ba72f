"""One TCP connection to argv[1]:argv[2] with a 3 s timeout: prints the result (open, dropped for a timeout, or the
error's name, e.g. ConnectionRefusedError) and the milliseconds it took."""

import socket
import sys
import time

t = time.monotonic()
s = socket.socket()
s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    r = "open"
except TimeoutError:
    r = "dropped"
except OSError as e:
    r = type(e).__name__
print(r, round((time.monotonic() - t) * 1000))
