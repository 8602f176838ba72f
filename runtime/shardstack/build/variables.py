"""docs/variables.md: every role's variables, generated from its meta/argument_specs.yml, and what production must set.

    python -m shardstack.build.variables --write docs/variables.md    (make docs-variables)
    python -m shardstack.build.variables --check docs/variables.md    exit 1 and the difference when stale

PRODUCTION below is the one list of variables a real cluster must set: their defaults suit the lab but are wrong or
unsafe on a real cluster. It lives here, not in the specs, because ansible-lint's role-arg-spec schema refuses any
extra key in an option (schema[role-arg-spec], not skippable). `shardstack check` warns about each one an inventory
leaves unset (shardstack.ops.production); tests/ops/test_variables_doc.py keeps the page current and the names real.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

COMMAND = "make docs-variables"
MODULE_COMMAND = "python -m shardstack.build.variables --write docs/variables.md"
MAX_DEFAULT = 60  # characters of a rendered default before it is shortened


@dataclass(frozen=True)
class ProductionVar:
    """A variable a real cluster must set, the inventory group whose hosts it matters on, and why."""

    role: str
    name: str
    group: str
    reason: str
    # (variable, values): it matters only where that variable, as the host sees it, is one of these (lower-case).
    only_if: tuple[str, tuple[str, ...]] | None = None


PRODUCTION: tuple[ProductionVar, ...] = (
    ProductionVar("firewall", "firewall_admin_networks", "all",
                  "empty admits only the controller of the last run: nobody else reaches ssh or the monitoring UIs, "
                  "and a run from another machine rewrites the rules"),
    ProductionVar("firewall", "firewall_client_networks", "loadbalancer",
                  "empty means the admin networks (by default the controller alone), so no client reaches the load "
                  "balancer's :443"),
    ProductionVar("grafana", "grafana_admin_password", "monitoring_server",
                  "the monitoring stage fails wherever Grafana's apt repository answers and this is empty",
                  only_if=("grafana_enabled", ("auto", "true"))),
    ProductionVar("loadbalancer", "loadbalancer_tls_cert", "loadbalancer",
                  "empty serves a certificate of the cluster's own CA, which no client trusts until it is handed "
                  "credentials/cluster-ca.crt.txt; set the site's certificate (and loadbalancer_tls_key)"),
    ProductionVar("prometheus", "prometheus_alertmanager_webhook_url", "monitoring_server",
                  "empty keeps every alert inside Alertmanager: nobody is told that a GPU, a node or a job failed",
                  only_if=("prometheus_alertmanager_enabled", ("true",))),
    ProductionVar("slurm", "slurm_users", "slurm_controller",
                  "slurm.conf enforces associations: until shardstack_user is listed with an account, Slurm refuses "
                  "every `shardstack train submit`",
                  only_if=("shardstack_scheduler", ("slurm",))),
)


@dataclass
class Option:
    name: str
    type: str
    description: str
    required: bool = False
    has_default: bool = False
    default: Any = None
    suboptions: list[Option] = field(default_factory=list)


@dataclass
class EntryPoint:
    name: str
    short_description: str
    options: list[Option]


@dataclass
class RoleSpec:
    name: str
    entry_points: list[EntryPoint]  # `main` first, then the others by name

    @property
    def short_description(self) -> str:
        return self.entry_points[0].short_description if self.entry_points else ""

    def option_names(self) -> set[str]:
        return {o.name for ep in self.entry_points for o in ep.options}


def roles_dir() -> Path:
    """roles/ of the checkout this module sits in (runtime/shardstack/build/ → the repository root), else the copy a
    wheel carries (shardstack/_ansible/roles). A build tool imports nothing from ops/ (tests/unit/test_imports.py)."""
    here = Path(__file__).resolve()
    for d in (here.parents[3] / "roles", here.parents[1] / "_ansible" / "roles"):
        if d.is_dir():
            return d
    raise SystemExit("cannot find the roles directory: pass --roles DIR")


def _type(spec: dict[str, Any]) -> str:
    kind = str(spec.get("type", "str"))
    if "elements" in spec:
        kind = f"list of {spec['elements']}" if kind == "list" else f"{kind} of {spec['elements']}"
    if choices := spec.get("choices"):
        kind += " (" + ", ".join(str(c) for c in choices) + ")"
    return kind


def _description(spec: dict[str, Any]) -> str:
    text = spec.get("description") or ""
    return " ".join(text) if isinstance(text, list) else str(text)


def _options(specs: dict[str, Any] | None, defaults: dict[str, Any]) -> list[Option]:
    options = []
    for name, spec in (specs or {}).items():
        spec = spec or {}
        has_default = "default" in spec or name in defaults
        options.append(Option(
            name=str(name), type=_type(spec), description=_description(spec), required=bool(spec.get("required")),
            has_default=has_default, default=spec["default"] if "default" in spec else defaults.get(name),
            suboptions=_options(spec.get("options"), {})))
    return options


def load_role(role_dir: Path) -> RoleSpec | None:
    """A role's entry points from meta/argument_specs.yml (None without one); a default the spec leaves out comes
    from defaults/main.yml."""
    spec_file = role_dir / "meta" / "argument_specs.yml"
    if not spec_file.is_file():
        return None
    specs = (yaml.safe_load(spec_file.read_text()) or {}).get("argument_specs") or {}
    defaults_file = role_dir / "defaults" / "main.yml"
    defaults = (yaml.safe_load(defaults_file.read_text()) or {}) if defaults_file.is_file() else {}
    names = sorted(specs, key=lambda n: (n != "main", n))
    return RoleSpec(role_dir.name, [
        EntryPoint(n, " ".join(str(specs[n].get("short_description") or "").split()),
                   _options(specs[n].get("options"), defaults if n == "main" else {}))
        for n in names])


def load_roles(roles: Path | None = None) -> list[RoleSpec]:
    """Every role under `roles` (default: the project's) that has an argument_specs, by name."""
    roles = roles or roles_dir()
    found = (load_role(d) for d in sorted(roles.iterdir()) if d.is_dir())
    return [r for r in found if r is not None]


def spec_defaults(roles: list[RoleSpec]) -> dict[str, Any]:
    """Every option's default by name (role variables are role-prefixed, so names do not collide)."""
    return {o.name: o.default for r in roles for ep in r.entry_points for o in ep.options if o.has_default}


# Ansible's documentation markup: C(code), O(option), V(value), I(italic), B(bold), M(module), U(url), L(text,url).
_MARKUP = re.compile(r"\b([CIOVBMUL])\(([^()]*)\)")


def _code(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" or text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _plain(text: str) -> str:
    # One table cell: pipes split cells, a bare <word> would be read as an HTML tag.
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _markdown(text: str) -> str:
    """One line of Markdown from a spec description (Ansible markup converted, cell-safe)."""
    out, last = [], 0
    text = " ".join(text.split())
    for m in _MARKUP.finditer(text):
        out.append(_plain(text[last:m.start()]))
        kind, body = m.groups()
        if kind in "COVM":
            out.append(_code(body))
        elif kind == "I":
            out.append(f"*{_plain(body)}*")
        elif kind == "B":
            out.append(f"**{_plain(body)}**")
        elif kind == "L" and "," in body:
            label, url = body.rsplit(",", 1)
            out.append(f"[{_plain(label.strip())}]({url.strip()})")
        else:
            out.append(_plain(body))
        last = m.end()
    out.append(_plain(text[last:]))
    return "".join(out)


def _scalar(value: Any) -> str:
    dumped = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False, allow_unicode=True)
    return " ".join(dumped.removesuffix("\n").removesuffix("...").split())


def _default(role: str, option: Option) -> str:
    if not option.has_default:
        return ""
    value = option.default
    # A string as written (its type is in its own column); lists and dicts as YAML flow.
    text = (" ".join(value.split()) or '""') if isinstance(value, str) else _scalar(value)
    if len(text) > MAX_DEFAULT:
        if isinstance(value, list):
            return f"{len(value)} items (roles/{role}/defaults/main.yml)"
        if isinstance(value, dict):
            return f"{len(value)} keys (roles/{role}/defaults/main.yml)"
        text = text[:MAX_DEFAULT - 1].rstrip() + "…"
    return _code(text)


def _mark(role: str, option: Option, production: set[tuple[str, str]]) -> str:
    if (role, option.name) in production:
        return "[**production**](#what-production-must-set)"
    return "required" if option.required else ""


def _rows(role: str, options: list[Option], production: set[tuple[str, str]], prefix: str = "") -> list[str]:
    rows = []
    for o in options:
        name = prefix + o.name
        rows.append(f"| {_code(name)} | {_plain(o.type)} | {_default(role, o)} | {_mark(role, o, production)} | "
                    f"{_markdown(o.description)} |")
        rows += _rows(role, o.suboptions, production, prefix=f"{name}[].")
    return rows


_TABLE_HEAD = ["| variable | type | default | must set | description |", "| --- | --- | --- | --- | --- |"]


def render(roles: list[RoleSpec]) -> str:
    """The Markdown page: what production must set, then one section per role with a table per entry point."""
    production = {(p.role, p.name) for p in PRODUCTION}
    lines = [
        f"<!-- Generated by `{COMMAND}` ({MODULE_COMMAND}) from roles/*/meta/argument_specs.yml. -->",
        "<!-- Edit the specs (or PRODUCTION in runtime/shardstack/build/variables.py), then regenerate; "
        "tests/ops/test_variables_doc.py fails while this file is stale. -->",
        "",
        "# Role variables",
        "",
        "Every variable of every role, from its `meta/argument_specs.yml` (Ansible validates a role's variables "
        "against it when the role starts). Set them in `inventory/<env>/group_vars/` or `host_vars/`; "
        "`inventory/sample/` is a starting point. A long default is shortened here; the role's `defaults/main.yml` "
        "holds it whole.",
        "",
        "## What production must set",
        "",
        "Their defaults suit the lab but not a real cluster. `shardstack check` warns about each one the inventory "
        "leaves unset on the hosts where it matters; setting it, even to its default, records the decision and "
        "ends the warning.",
        "",
        "| variable | role | hosts | why |",
        "| --- | --- | --- | --- |",
    ]
    for p in PRODUCTION:
        hosts = p.group + (f", when `{p.only_if[0]}` is {' or '.join(p.only_if[1])}" if p.only_if else "")
        lines.append(f"| {_code(p.name)} | [{p.role}](#{p.role}) | {hosts} | {_markdown(p.reason)} |")
    lines += ["", "Roles: " + ", ".join(f"[{r.name}](#{r.name})" for r in roles) + "."]
    for role in roles:
        lines += ["", f"## {role.name}", "", _markdown(role.short_description)]
        for ep in role.entry_points:
            if ep.name != "main":
                lines += ["", f"### Entry point `{ep.name}` (`tasks_from: {ep.name}`)", "",
                          _markdown(ep.short_description)]
            lines += [""] + (_TABLE_HEAD + _rows(role.name, ep.options, production) if ep.options
                             else ["No variables."])
    return "\n".join(lines) + "\n"


def generate(roles: Path | None = None) -> str:
    return render(load_roles(roles))


def diff(current: str, expected: str, path: str) -> str:
    return "".join(difflib.unified_diff(current.splitlines(keepends=True), expected.splitlines(keepends=True),
                                        fromfile=f"{path} (as it is)", tofile=f"{path} (generated)"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardstack.build.variables", description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", type=Path, metavar="PATH", help="write the page to PATH")
    mode.add_argument("--check", type=Path, metavar="PATH", help="exit 1, showing the difference, if PATH is stale")
    ap.add_argument("--roles", type=Path, help="roles directory (default: the project's)")
    args = ap.parse_args(argv)
    page = generate(args.roles)
    if args.write:
        args.write.write_text(page)
        print(f"wrote {args.write}", file=sys.stderr)
    elif args.check:
        current = args.check.read_text() if args.check.is_file() else ""
        if current != page:
            print(diff(current, page, str(args.check)), end="")
            print(f"{args.check} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
