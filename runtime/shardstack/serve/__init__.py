"""The inference service: an OpenAI-compatible completions API over one continuously batched engine loop.

Layout: `settings` (what the service was told), `lifecycle` (loading → ready → draining, readiness and the
watchdog), `routes` (the HTTP handlers), `app` (the Starlette app: error bodies, metrics middleware, lifespan),
`engine` (the step loop on its own thread), `scheduler` (the queue, KV-cache slots and admission), `output`
(sampling, stop strings and EOS, delivery to the waiting request), `request` (a request as the engine holds it),
`runner` (the model's prefill and decode passes), `sampling` (temperature / top-p with a per-request generator),
`text` (byte tokenizer, stop sequences, UTF-8-safe streaming), `protocol` (request validation and error bodies),
`metrics`, `notify` (systemd readiness and watchdog), `server` (uvicorn with drain-on-SIGTERM), `demo` (a random
model to try it).
"""
