"""The inference service: an OpenAI-compatible completions API over one continuously batched engine loop.

Layout: `settings` (what the service was told), `lifecycle` (loading → ready → draining, readiness and the
watchdog), `routes` (the HTTP handlers), `app` (the Starlette app: error bodies, metrics middleware, lifespan),
`scheduler` (admission, KV-cache slots and the engine loop on its own thread), `runner` (the model's prefill and
decode passes), `sampling` (temperature / top-p with a per-request generator), `text` (byte tokenizer, stop
sequences, UTF-8-safe streaming), `protocol` (request validation and error bodies), `metrics`, `notify` (systemd
readiness and watchdog), `server` (uvicorn with drain-on-SIGTERM), `demo` (a random model to try it).
"""
