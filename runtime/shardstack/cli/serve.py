"""`shardstack serve --model DIR` (the inference service, docs/serving.md), `shardstack serve rollout` (upgrade the
cluster's inference nodes one at a time) and `shardstack serve publish JOB[@STEP]` (a job's checkpoint → a signed
export → exports/current → rollout; docs/operations.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path

from shardstack.cli.checkpoint import key_args, load_key
from shardstack.cli.inventory import add_inventory_arg, load_cluster
from shardstack.cli.output import EXIT_FAILED_HOSTS, EXIT_OK, LiveProgress, console, summary_table
from shardstack.errors import ShardstackError

log = logging.getLogger(__name__)

FAILPOINT_ENV = "SHARDSTACK_SERVE_FAILPOINT"  # test-only fault injection (e.g. engine_hang)


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names the type in errors
    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible inference service for an exported model")
    # Not required: `serve rollout` needs none; `serve` itself checks for it.
    p.add_argument("--model", type=Path, default=None,
                   help="a `shardstack export` directory (either format) or a Hugging Face Llama directory; its "
                        "tokenizer.json is the tokenizer (none: bytes)")
    p.add_argument("--model-name", default=None, help="name clients pass as `model` (default: the dir's name)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    # The defaults are the inference_service role's (roles/inference_service/defaults/main.yml, where 0 means "the
    # CLI's automatic value", None here): a node and `shardstack serve` by hand behave alike. Tested.
    p.add_argument("--max-concurrency", type=_positive(int), default=8,
                   help="requests decoded together, = KV-cache slots; 1 disables batching (default 8)")
    p.add_argument("--max-queue", type=int, default=32,
                   help="requests waiting for a slot before new ones get 429 (default 32)")
    p.add_argument("--max-tokens", type=_positive(int), default=None,
                   help="ceiling for a request's max_tokens (default: the model context)")
    p.add_argument("--context", type=_positive(int), default=None,
                   help="tokens per KV-cache slot, at most the model's (default: the model's context)")
    p.add_argument("--max-body-bytes", type=_positive(int), default=None,
                   help="request body limit (default: room for the longest prompt that fits the context)")
    p.add_argument("--max-prefill-tokens", type=_positive(int), default=4096,
                   help="prompt tokens prefilled in one engine step; longer prompts are chunked (default 4096)")
    key_args(p, "serve a model directory without checking its signed manifest: a directory you trust (a pretrained "
                "Hugging Face download, a local export made with --allow-unsigned), loaded in place")
    p.add_argument("--stage-dir", type=Path, default=Path("/var/tmp"),
                   help="where the verified private copy of the model is made while it loads (default /var/tmp)")
    p.add_argument("--token-file", type=Path, default=None,
                   help="file holding a bearer token required on /v1/* and /info")
    p.add_argument("--tls-cert", type=Path, default=None, metavar="FILE",
                   help="PEM certificate (chain): serve HTTPS, TLS 1.2 or newer, so the load balancer reaches this "
                        "node over TLS with the cluster CA; needs --tls-key. systemd hands it as a credential of "
                        "the unit (default: plain HTTP)")
    p.add_argument("--tls-key", type=Path, default=None, metavar="FILE",
                   help="PEM private key of --tls-cert; systemd hands it as a credential of the unit")
    p.add_argument("--engine", default="builtin", choices=["builtin", "vllm"],
                   help="builtin (default) or vllm: vLLM's server, run by a Python that has vLLM (docs/serving.md); "
                        "the built-in engine's --max-queue, --max-tokens, --max-body-bytes, --device, --stall-seconds "
                        "and --access-log do not apply to it")
    p.add_argument("--tensor-parallel", type=_positive(int), default=1,
                   help="vllm: GPUs one replica shards its layers over (default 1)")
    p.add_argument("--pipeline-parallel", type=_positive(int), default=1,
                   help="vllm: nodes one replica's layers are split over, as pipeline stages on the Ray cluster this "
                        "node heads (default 1: this node alone). Every node stages the export with `serve stage` "
                        "under the same --stage-dir, which this command then uses too")
    p.add_argument("--kv-cache-gib", type=_positive(int), default=None,
                   help="vllm on CPU: KV-cache space in GiB (default: vLLM's)")
    p.add_argument("--device", default="auto", help="auto (GPU when present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights/KV-cache dtype (auto: bf16 on a GPU that has it, else fp32)")
    p.add_argument("--threads", type=_positive(int), default=None,
                   help="torch intra-op CPU threads (default: CPUs - 1)")
    p.add_argument("--stall-seconds", type=_positive(float), default=30.0,
                   help="engine loop silent this long = hung: /health 503, no watchdog ping (default 30)")
    p.add_argument("--drain-seconds", type=float, default=20.0,
                   help="on SIGTERM, time in-flight requests get to finish (default 20)")
    p.add_argument("--drain-quiet-seconds", type=float, default=0.0,
                   help="and, within that time, how long no request must have been turned away before the server "
                        "stops: longer than a load balancer takes to see a draining replica down (default 0)")
    p.add_argument("--access-log", nargs="?", const="stdout", default="auto",
                   choices=["auto", "journal", "stdout", "off"],
                   help="one entry per request: journal (structured fields), stdout, off; auto (default): journal "
                        "when run by systemd with the journal, else off. Bare --access-log: stdout")
    p.add_argument("--journal-socket", default="/run/systemd/journal/socket",
                   help="journald's native socket the journal access log writes to")
    p.set_defaults(func=run)

    actions = p.add_subparsers(dest="serve_command", metavar="ACTION")
    r = actions.add_parser("rollout", help="upgrade the inference nodes one at a time (drain, upgrade, healthy, next)")
    add_inventory_arg(r)
    r.add_argument("--limit", help="only these inference nodes")
    r.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    r.set_defaults(func=_rollout)
    st = actions.add_parser("stage", help="verify the signed export and make this node's copy of it where vLLM's "
                                          "pipeline-parallel workers load it (the Ray worker units run it at start)")
    st.add_argument("--model", type=Path, required=True, help="the export (exports/current on shared storage)")
    key_args(st)
    st.add_argument("--into", type=Path, required=True,
                    help="the staging directory, the same on every node of the replica (earlier copies are removed)")
    st.set_defaults(func=_stage)
    pub = actions.add_parser("publish", help="export JOB's checkpoint (at STEP, else its newest valid one) on a train "
                                             "node, signed with its key; point exports/current at it; roll out")
    pub.add_argument("job", metavar="JOB[@STEP]", help="a job submitted with `train submit`, e.g. run1 or run1@1200")
    pub.add_argument("--no-rollout", action="store_true",
                     help="only export and switch exports/current (inference nodes load it on their next rollout)")
    add_inventory_arg(pub)
    pub.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    pub.set_defaults(func=_publish)
    sc = actions.add_parser("scale", help="with Slurm-run replicas (inference_service_scheduled): submit or cancel "
                                          "replica jobs so that N are queued or running; without --replicas: list")
    sc.add_argument("--replicas", type=_non_negative, default=None, metavar="N", help="the count to reach (0: none)")
    sc.add_argument("--account", default="inference", help="the Slurm account of replica jobs (default inference)")
    sc.add_argument("--qos", default="inference", help="their QOS, the one that preempts training (default inference)")
    add_inventory_arg(sc)
    sc.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    sc.set_defaults(func=_scale)
    au = actions.add_parser("autoscale", help="on the Slurm controller (the unit shardstack-autoscale runs it, "
                                              "submitting as the job account): every interval, read the tier's load "
                                              "from Prometheus, decide a replica count (docs/serving.md, "
                                              "\"Autoscaling\") and submit or cancel replica jobs; one line per "
                                              "decision with its inputs")
    au.add_argument("--config", type=Path, required=True, metavar="FILE",
                    help="the autoscaler's YAML (Prometheus, policy, Slurm account and QOS, state and metrics files); "
                         "the role renders /etc/shardstack/autoscale.yaml")
    au.add_argument("--check", action="store_true", help="check the config and exit (the role's validate)")
    au.add_argument("--once", action="store_true", help="one decision, then exit (1 when it could not decide)")
    au.add_argument("--dry-run", action="store_true", help="decide and log, never submit or cancel")
    au.set_defaults(func=_autoscale)


def _stage(args: argparse.Namespace) -> int:
    """The copy a pipeline-parallel replica's worker node loads: named after the signed manifest, so it is the path
    the head's vLLM passes its workers when the head stages the same export."""
    from shardstack.model.manifest import stage_verified

    key = load_key(args)
    if key is None:  # nothing to verify: the workers load the export in place, as the head does
        print(args.model)
        return EXIT_OK
    args.into.mkdir(parents=True, exist_ok=True)
    staged = stage_verified(args.model, key, args.into, shared_name=True)
    log.info("verified %s: %d files, %.1f MiB, step %s, signed with key id %s", args.model, staged.files,
             staged.bytes / 2**20, staged.step, staged.key_id)
    print(staged.path)
    return EXIT_OK


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ShardstackError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token or any(c.isspace() for c in token):
        raise ShardstackError(f"token file {path} must hold one non-empty token without whitespace")
    return token


def _check_tls(cert: Path | None, key: Path | None) -> None:
    """Both or neither; readable; a certificate and its key. Checked before the model loads, so a bad pair is one
    line and exit 2, not a traceback from the server's start."""
    if cert is None and key is None:
        return
    if cert is None or key is None:
        raise ShardstackError("--tls-cert and --tls-key go together: both (HTTPS) or neither (plain HTTP)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            path.read_bytes()
        except OSError as exc:
            raise ShardstackError(f"cannot read {flag} {path}: {exc.strerror}") from None
    try:
        # A password callable: an encrypted key fails here instead of OpenSSL prompting for its pass phrase.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        why = ("the key does not belong to the certificate" if exc.reason == "KEY_VALUES_MISMATCH"
               else "not a PEM certificate and an unencrypted PEM private key")
        raise ShardstackError(f"--tls-cert {cert}, --tls-key {key}: {why}") from None


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        raise ShardstackError("`shardstack serve` needs --model DIR (or the action `rollout`)")
    from shardstack.model.artifact import check_model_dir  # torch: `serve rollout` runs on a controller without it

    check_model_dir(args.model)
    if args.max_queue < 0:
        raise ShardstackError("--max-queue must be >= 0")
    token = _read_token(args.token_file) if args.token_file else None
    _check_tls(args.tls_cert, args.tls_key)
    key = load_key(args)
    if key is None:
        log.warning("serving %s unverified (--allow-unsigned)", args.model)
    elif not args.stage_dir.is_dir():
        raise ShardstackError(f"--stage-dir {args.stage_dir} is not a directory")
    if not 0 < args.port < 65536:
        raise ShardstackError(f"--port {args.port} is not a valid port")

    if args.engine == "vllm":
        from shardstack.serve.vllm import run as run_vllm

        return run_vllm(args, key, token)
    if args.tensor_parallel != 1 or args.pipeline_parallel != 1 or args.kv_cache_gib is not None:
        raise ShardstackError("--tensor-parallel, --pipeline-parallel and --kv-cache-gib are options of --engine vllm",
                              hint="the built-in engine serves on one device; its KV cache is --context × "
                                   "--max-concurrency")

    import torch  # heavy: only once the arguments are known to be good

    from shardstack.serve.lifecycle import Service
    from shardstack.serve.server import serve
    from shardstack.serve.settings import ServeSettings, resolve_device

    # Before the server starts, so a GPU node that cannot run CUDA exits 2 with the cause instead of serving on CPU.
    device = str(resolve_device(args.device))
    # Leave a core to the HTTP event loop: intra-op threads competing with it for every core cost more in
    # latency than they gain on the small per-step matmuls of decoding.
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) - 1))
    failpoint = os.environ.get(FAILPOINT_ENV) or None
    if failpoint:
        log.warning("fault injection active: %s=%s", FAILPOINT_ENV, failpoint)
    settings = ServeSettings(
        model_dir=args.model,
        model_name=args.model_name,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_tokens=args.max_tokens,
        context=args.context,
        max_body_bytes=args.max_body_bytes,
        max_prefill_tokens=args.max_prefill_tokens,
        token=token,
        key=key,
        stage_dir=args.stage_dir,
        device=device,
        dtype=args.dtype,
        stall_seconds=args.stall_seconds,
        drain_seconds=args.drain_seconds,
        drain_quiet_seconds=args.drain_quiet_seconds,
        access_log=args.access_log,
        journal_socket=args.journal_socket,
        failpoint=failpoint,
    )
    level = logging.getLogger().getEffectiveLevel()
    return serve(Service(settings), args.host, args.port, log_level=logging.getLevelName(level).lower(),
                 tls_cert=args.tls_cert, tls_key=args.tls_key)


def _rollout(args: argparse.Namespace) -> int:
    from shardstack.ops.serve import rollout

    result = rollout(load_cluster(args), limit=args.limit, on_event=None if args.json else LiveProgress())
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        console.print(summary_table(result, "serve rollout"))
    return EXIT_OK if result.success else EXIT_FAILED_HOSTS


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _scale(args: argparse.Namespace) -> int:
    from shardstack.ops import replicas

    settings = replicas.ReplicaSettings(account=args.account, qos=args.qos)  # bad names: one line, before the inventory
    slurm = replicas.ClusterSlurm.of(load_cluster(args))
    if args.replicas is None:
        jobs, submitted, cancelled = replicas.replicas(slurm), [], []
    else:
        done = replicas.scale(slurm, args.replicas, settings)
        jobs, submitted, cancelled = done.before, done.submitted, done.cancelled
    if args.json:
        print(json.dumps({"jobs": [dataclasses.asdict(j) for j in jobs], "submitted": submitted,
                          "cancelled": cancelled}, indent=2))
        return EXIT_OK
    for j in jobs:
        print(f"replica job {j.job_id}: {j.state}{' on ' + j.node if j.node else ''}"
              f"{' (cancelled)' if j.job_id in cancelled else ''}")
    if args.replicas is not None:
        print(f"{len(jobs)} → {args.replicas} replica(s): submitted {submitted or 'none'}, cancelled "
              f"{cancelled or 'none'}")
    elif not jobs:
        print("no replica jobs")
    return EXIT_OK


def _autoscale(args: argparse.Namespace) -> int:
    import signal

    from shardstack.ops import autoscale
    from shardstack.ops.replicas import LocalSlurm

    cfg = autoscale.AutoscaleConfig.load(args.config)
    if args.check:
        print(f"{args.config}: a valid autoscaler config ({cfg.min_replicas}..{cfg.max_replicas} replicas)")
        return EXIT_OK
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    decided = autoscale.run(cfg, LocalSlurm(cfg.job_user), once=args.once, dry_run=args.dry_run,
                            stopping=lambda: stopping)
    return 1 if args.once and not decided else EXIT_OK


def _publish(args: argparse.Namespace) -> int:
    from shardstack.ops.serve import parse_job_ref, publish

    parse_job_ref(args.job)  # bad input: one line before the inventory is read
    done = publish(load_cluster(args), args.job, rollout_after=not args.no_rollout,
                   on_event=None if args.json else LiveProgress())
    ok = done.rollout is None or done.rollout.success
    if args.json:
        print(json.dumps(done.to_dict(), indent=2))
        return EXIT_OK if ok else EXIT_FAILED_HOSTS
    exp = done.export
    print(f"exported {done.job} step {done.step} ({'signed' if exp.signed else 'UNSIGNED'}) on {exp.host} → "
          f"{exp.out_dir}; {exp.current} → it")
    if done.rollout is None:
        console.print("not rolled out (--no-rollout): shardstack serve rollout loads it", highlight=False)
    else:
        console.print(summary_table(done.rollout, "serve rollout"))
    return EXIT_OK if ok else EXIT_FAILED_HOSTS
