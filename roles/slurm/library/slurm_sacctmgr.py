#!/usr/bin/python
"""Slurm accounting entities (cluster, QOS, accounts, users) made to match a declared state with sacctmgr.

Reads the current state with `sacctmgr -nP show …`, compares field by field (TRES specs as maps, lists as sets,
wall times in minutes) and runs `sacctmgr -i add|modify|delete` only for what differs: `changed` is true only
then. Only the fields a declared entity names are managed; an empty string clears a field. In check mode it
reads and reports the commands it would run.
"""

from __future__ import annotations

from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: slurm_sacctmgr
short_description: Make Slurm's cluster, QOS, accounts and users match a declared state (sacctmgr)
description:
  - Reads with C(sacctmgr -nP show), changes with C(sacctmgr -i) only what differs.
  - Only the fields an entity names are managed; an empty string clears a field (C(-1) to sacctmgr).
options:
  cluster: {description: ClusterName of slurm.conf, type: str, required: true}
  qos: {description: QOS entries (name, state, description, priority, flags, preempt, preempt_mode, grace_time,
        max_tres_per_user, max_tres_per_job, max_tres_per_account, grp_tres, max_jobs_per_user,
        max_submit_jobs_per_user, max_wall), type: list, elements: dict, default: []}
  accounts: {description: Accounts (name, state, description, organization, parent, fairshare, qos, default_qos,
             grp_tres, grp_jobs, max_jobs), type: list, elements: dict, default: []}
  users: {description: Users (name, state, accounts, default_account, qos, default_qos, admin_level), type: list,
          elements: dict, default: []}
  sacctmgr: {description: Path of sacctmgr, type: str, default: sacctmgr}
"""

RETURN = r"""
commands: {description: the sacctmgr argument lists run (or that would run in check mode), type: list,
           returned: always}
"""


# declared field -> (sacctmgr show format name, sacctmgr set option, kind)
QOS_FIELDS = {
    "description": ("description", "Description", "text"),
    "priority": ("priority", "Priority", "int"),
    "flags": ("flags", "Flags", "set"),
    "preempt": ("preempt", "Preempt", "set"),  # the QOS this one's jobs may preempt (PreemptType=preempt/qos)
    "preempt_mode": ("preemptmode", "PreemptMode", "mode"),
    "grace_time": ("gracetime", "GraceTime", "seconds"),  # what a preempted job of this QOS gets (preempt/qos)
    "max_tres_per_user": ("maxtrespu", "MaxTRESPerUser", "tres"),
    "max_tres_per_job": ("maxtres", "MaxTRESPerJob", "tres"),
    "max_tres_per_account": ("maxtrespa", "MaxTRESPerAccount", "tres"),
    "grp_tres": ("grptres", "GrpTRES", "tres"),
    "max_jobs_per_user": ("maxjobspu", "MaxJobsPerUser", "int"),
    "max_submit_jobs_per_user": ("maxsubmitpu", "MaxSubmitJobsPerUser", "int"),
    "max_wall": ("maxwall", "MaxWall", "wall"),
}
# Association fields of an account (its own association on the cluster, user empty).
ACCOUNT_ASSOC_FIELDS = {
    "parent": ("parentname", "Parent", "str"),
    "fairshare": ("fairshare", "Fairshare", "int"),
    "qos": ("qos", "QOS", "set"),
    "default_qos": ("defaultqos", "DefaultQOS", "str"),
    "grp_tres": ("grptres", "GrpTRES", "tres"),
    "grp_jobs": ("grpjobs", "GrpJobs", "int"),
    "max_jobs": ("maxjobs", "MaxJobs", "int"),
}
ACCOUNT_FIELDS = {
    "description": ("descr", "Description", "text"),
    "organization": ("org", "Organization", "text"),
}
USER_ASSOC_FIELDS = {
    "qos": ("qos", "QOS", "set"),
    "default_qos": ("defaultqos", "DefaultQOS", "str"),
}
USER_FIELDS = {
    "default_account": ("defaultaccount", "DefaultAccount", "str"),
    "admin_level": ("adminlevel", "AdminLevel", "str"),
}
ADMIN_LEVELS = {"none": "None", "operator": "Operator", "administrator": "Administrator", "admin": "Administrator"}


def wall_minutes(value: Any) -> int | None:
    """Slurm time specs (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) → minutes (seconds round up); empty or
    unlimited → None. Raises ValueError for anything else."""
    text = "" if value is None else str(value).strip()
    if text in ("", "-1", "UNLIMITED", "INFINITE"):
        return None
    days = 0
    if "-" in text:
        head, text = text.split("-", 1)
        days = int(head)
        hours, minutes, seconds = ([int(x) for x in text.split(":")] + [0, 0])[:3]
    else:
        parts = [int(x) for x in text.split(":")]
        if len(parts) > 3:
            raise ValueError(f"not a Slurm time: {value!r}")
        hours, minutes, seconds = ([0] * (3 - len(parts)) + parts) if len(parts) == 3 else \
            (0, parts[0], parts[1] if len(parts) == 2 else 0)
    return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def tres_map(value: Any) -> dict[str, str]:
    """'gres/gpu=8,node=2' → {'gres/gpu': '8', 'node': '2'}; empty → {}."""
    out: dict[str, str] = {}
    for item in str(value or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep or not key or not val:
            raise ValueError(f"not a TRES spec: {value!r} (want name=count[,name=count])")
        out[key.strip().lower()] = val.strip()
    return out


def normalise(kind: str, value: Any) -> Any:
    if kind == "int":
        return None if value in (None, "", -1, "-1") else int(value)
    if kind == "set":
        items = value if isinstance(value, list) else str(value or "").split(",")
        return frozenset(str(i).strip().lower() for i in items if str(i).strip())
    if kind == "tres":
        return tres_map(value)
    if kind == "wall":
        return wall_minutes(value)
    if kind == "seconds":  # declared in seconds, shown as [D-]HH:MM:SS
        text = str(value if value is not None else "").strip()
        if text in ("", "-1"):
            return None
        try:
            if ":" not in text:
                return int(text)
            days, _, clock = text.rpartition("-")
            hours, minutes, seconds = (int(x) for x in clock.split(":"))
        except ValueError:
            raise ValueError(f"not a number of seconds: {value!r} (e.g. grace_time: 300)") from None
        return (int(days or 0) * 24 + hours) * 3600 + minutes * 60 + seconds
    if kind == "text":  # sacctmgr stores a ' as a ` (it quotes values with ' in its SQL)
        return str(value or "").strip().replace("'", "`")
    if kind == "mode":  # sacctmgr shows PreemptMode in capitals, "cluster" when unset (slurm.conf's applies)
        mode = str(value or "").strip().lower()
        return "" if mode in ("", "cluster") else mode
    return "" if value is None else str(value).strip()


def render(kind: str, desired: Any, current: Any) -> str:
    """The value for `set Option=…` that turns `current` into `desired` (both normalised; not for sets)."""
    if kind == "tres":
        parts = [f"{k}={v}" for k, v in sorted(desired.items())]
        parts += [f"{k}=-1" for k in sorted(set(current) - set(desired))]  # clear the ones no longer declared
        return ",".join(parts) if parts else "-1"
    if kind in ("int", "wall", "seconds"):
        return "-1" if desired is None else str(desired)
    if kind == "mode":
        return desired.upper() or "CLUSTER"
    return desired


def differences(fields: dict[str, tuple[str, str, str]], declared: dict[str, Any],
                current: dict[str, str] | None) -> list[str]:
    """`Option=value` settings for every declared field whose value differs from the current row."""
    out = []
    for key, (column, option, kind) in fields.items():
        if declared.get(key) is None:
            continue  # not managed
        want = normalise(kind, declared[key])
        have = normalise(kind, (current or {}).get(column, ""))
        if key == "admin_level":
            want = ADMIN_LEVELS.get(str(declared[key]).lower(), str(declared[key]))
        if want != have:
            raw = declared[key]
            if kind == "set":  # as declared: names keep their case (DenyOnLimit)
                value = ",".join(str(i).strip() for i in (raw if isinstance(raw, list) else str(raw).split(","))
                                 if str(i).strip())
            elif kind == "text":  # as declared: sacctmgr stores its ' as ` itself
                value = str(raw).strip()
            else:
                value = render(kind, want, have)
            out.append(f"{option}={value}")
    return out


class Sacctmgr:
    def __init__(self, module: AnsibleModule, binary: str) -> None:
        self.module, self.binary = module, binary
        self.commands: list[list[str]] = []

    def show(self, entity: str, columns: list[str], **where: str) -> list[dict[str, str]]:
        conditions = ["where", *(f"{k}={v}" for k, v in where.items())] if where else []
        argv = [self.binary, "-nP", "show", entity, *conditions, "format=" + ",".join(columns)]
        rc, out, err = self.module.run_command(argv)
        if rc != 0:
            self.module.fail_json(msg=f"{' '.join(argv)} failed (rc {rc}): {err.strip() or out.strip()}",
                                  commands=self.commands)
        rows = []
        for line in out.splitlines():
            if line.strip():
                values = line.split("|", len(columns) - 1)  # a "|" in the last column stays in it
                rows.append(dict(zip(columns, values + [""] * (len(columns) - len(values)), strict=True)))
        return rows

    def run(self, *args: str) -> None:
        argv = [self.binary, "-i", *args]
        self.commands.append(argv)
        if self.module.check_mode:
            return
        rc, out, err = self.module.run_command(argv)
        if rc != 0:
            self.module.fail_json(msg=f"{' '.join(argv)} failed (rc {rc}): {err.strip() or out.strip()}",
                                  commands=self.commands)


def _columns(*tables: dict[str, tuple[str, str, str]]) -> list[str]:
    return [col for table in tables for col, _opt, _kind in table.values()]


def apply(module: AnsibleModule) -> list[list[str]]:
    p = module.params
    cluster = p["cluster"]
    sm = Sacctmgr(module, p["sacctmgr"])
    qos_in = [q for q in p["qos"] if q.get("state", "present") == "present"]
    accounts_in = [a for a in p["accounts"] if a.get("state", "present") == "present"]
    users_in = [u for u in p["users"] if u.get("state", "present") == "present"]

    if not sm.show("cluster", ["cluster"], cluster=cluster):
        sm.run("add", "cluster", cluster)

    # QOS before the accounts and users that name them, and all of them before their fields: a QOS's preempt list
    # may name one declared after it.
    qos_now = {r["name"]: r for r in sm.show("qos", ["name", *_columns(QOS_FIELDS)])}
    for q in qos_in:
        if q["name"] not in qos_now:
            sm.run("add", "qos", q["name"])
    for q in qos_in:
        changes = differences(QOS_FIELDS, q, qos_now.get(q["name"]))
        if changes:
            sm.run("modify", "qos", "where", f"name={q['name']}", "set", *changes)

    assoc_cols = ["account", "user", *_columns(ACCOUNT_ASSOC_FIELDS)]
    assocs = sm.show("assoc", assoc_cols, cluster=cluster)
    account_rows = {r["account"]: r for r in assocs if not r["user"]}
    info = {r["account"]: r for r in sm.show("account", ["account", *_columns(ACCOUNT_FIELDS)])}
    for a in accounts_in:
        name = a["name"]
        declared = {**a, "parent": a.get("parent") or "root"}
        if name not in account_rows:
            sm.run("add", "account", name, f"cluster={cluster}",
                   *[c for c in differences(ACCOUNT_FIELDS, a, None)],
                   *[c for c in differences(ACCOUNT_ASSOC_FIELDS, declared, None) if not c.endswith("=-1")])
            continue
        changes = differences(ACCOUNT_FIELDS, a, info.get(name))
        if changes:
            sm.run("modify", "account", "where", f"name={name}", "set", *changes)
        changes = differences(ACCOUNT_ASSOC_FIELDS, declared, account_rows[name])
        if changes:
            sm.run("modify", "account", "where", f"name={name}", f"cluster={cluster}", "set", *changes)

    user_rows = {r["user"]: r for r in sm.show("user", ["user", *_columns(USER_FIELDS)])}
    user_assocs: dict[str, dict[str, dict[str, str]]] = {}
    for r in assocs:
        if r["user"]:
            user_assocs.setdefault(r["user"], {})[r["account"]] = r
    for u in users_in:
        name, accounts = u["name"], list(u.get("accounts") or [])
        if not accounts:
            module.fail_json(msg=f"slurm user {name}: list at least one account", commands=sm.commands)
        declared = {**u, "default_account": u.get("default_account") or accounts[0]}
        if declared["default_account"] not in accounts:
            module.fail_json(msg=f"slurm user {name}: default_account {declared['default_account']} is not one of "
                                 f"its accounts {accounts}", commands=sm.commands)
        have = user_assocs.get(name, {})
        for account in accounts:
            if account not in have:
                sm.run("add", "user", name, f"account={account}", f"cluster={cluster}",
                       *[c for c in differences(USER_ASSOC_FIELDS, u, None) if not c.endswith("=")])
            else:
                changes = differences(USER_ASSOC_FIELDS, u, have[account])
                if changes:
                    sm.run("modify", "user", "where", f"name={name}", f"account={account}", f"cluster={cluster}",
                           "set", *changes)
        changes = differences(USER_FIELDS, declared, user_rows.get(name))
        if changes:
            sm.run("modify", "user", "where", f"name={name}", "set", *changes)
        # Associations no longer declared go; root's own (Slurm's, user root under account root) stays.
        for account in sorted(set(have) - set(accounts) - {"root"}):
            sm.run("delete", "user", "where", f"name={name}", f"account={account}", f"cluster={cluster}")

    for u in p["users"]:
        if u.get("state") == "absent" and u["name"] in user_rows:
            sm.run("delete", "user", "where", f"name={u['name']}")
    for a in p["accounts"]:
        if a.get("state") == "absent" and a["name"] in info:
            sm.run("delete", "account", "where", f"name={a['name']}")
    for q in p["qos"]:
        if q.get("state") == "absent" and q["name"] in qos_now:
            sm.run("delete", "qos", "where", f"name={q['name']}")
    return sm.commands


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "cluster": {"type": "str", "required": True},
            "qos": {"type": "list", "elements": "dict", "default": []},
            "accounts": {"type": "list", "elements": "dict", "default": []},
            "users": {"type": "list", "elements": "dict", "default": []},
            "sacctmgr": {"type": "str", "default": "sacctmgr"},
        },
        supports_check_mode=True,
    )
    for kind in ("qos", "accounts", "users"):
        for item in module.params[kind]:
            if not item.get("name"):
                module.fail_json(msg=f"every entry of {kind} needs a name: {item}")
            if item.get("state", "present") not in ("present", "absent"):
                module.fail_json(msg=f"{kind} {item['name']}: state must be present or absent")
    try:
        commands = apply(module)
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=bool(commands), commands=commands)


if __name__ == "__main__":
    main()
