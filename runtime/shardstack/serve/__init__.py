"""The inference service: an OpenAI-compatible completions API over one continuously batched engine loop.

Layout: `engine` (KV-cache slots, admission, prefill + decode steps on a dedicated thread), `sampling`
(temperature / top-p with a per-request generator), `text` (byte tokenizer, stop sequences, UTF-8-safe
streaming), `protocol` (request validation and error bodies), `app` (Starlette routes, health, metrics),
`notify` (systemd readiness and watchdog), `server` (uvicorn with drain-on-SIGTERM), `cli` (`shardstack serve`).
"""
