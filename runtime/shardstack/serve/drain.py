"""When a drain on SIGTERM may end, for both engines.

Not as soon as nothing is in flight: a load balancer takes a draining replica out only after its health checks have
failed a few times, and until then it goes on sending requests, which the replica turns away with a 503 that the
balancer retries elsewhere. A replica that closed its connections in that window would reset a request the balancer
has already sent, and the balancer cannot retry that one (it cannot tell it from a request that killed its backend):
the client would get a 502. So the drain also waits until no request was turned away for `quiet` seconds, counted
from the SIGTERM on; `deadline` bounds it all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class DrainClock:
    seconds: float  # the whole drain, in-flight requests included
    quiet: float  # no request turned away for this long: the balancer no longer sends any
    started: float = field(default_factory=time.monotonic)
    last_turned_away: float = 0.0

    def __post_init__(self) -> None:
        self.last_turned_away = self.started

    def turned_away(self) -> None:
        self.last_turned_away = time.monotonic()

    def timed_out(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.started + self.seconds

    def done(self, in_flight: int, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.timed_out(now) or (in_flight == 0 and now - self.last_turned_away >= self.quiet)
