"""The service account's pinned uid/gid (shardstack_uid, shardstack_gid): every role that creates it creates it
with them, after shardstack_common's service_account.yml has checked that nothing on the node stands in the way. On
shared storage (NFS, root_squash) a node can write checkpoints only if its account has the numbers that own them."""

from __future__ import annotations

import grp
import json
import pwd
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardstack.ops.runner import run_playbook

ROLES = Path(__file__).resolve().parents[2] / "roles"

PASSWD = {"root": ["x", "0", "0", "root", "/root", "/bin/bash"],
          "_apt": ["x", "42", "65534", "", "/nonexistent", "/usr/sbin/nologin"]}
GROUP = {"root": ["x", "0", ""], "adm": ["x", "4", ""]}


def _problems(role_eval: Any, debian_container: dict, passwd: dict, group: dict, **kw: Any) -> list[str]:
    r = role_eval("training_runtime", debian_container, __passwd=passwd, __group=group, **kw)
    return r["__passwd | shardstack_account_problems(__group, training_runtime_user, training_runtime_group, "
             "shardstack_uid, shardstack_gid)"]


def test_defaults_pin_both_ids(role_eval: Any, debian_container: dict) -> None:
    r = role_eval("training_runtime", debian_container)
    assert (int(r["shardstack_uid"]), int(r["shardstack_gid"])) == (2990, 2990)


def test_a_new_node_or_an_account_with_the_pinned_ids_passes(role_eval: Any, debian_container: dict) -> None:
    assert _problems(role_eval, debian_container, PASSWD, GROUP) == []
    mine_p = {**PASSWD, "shardstack": ["x", "2990", "2990", "shardstack runtime", "/var/lib/shardstack", "/bin/false"]}
    mine_g = {**GROUP, "shardstack": ["x", "2990", ""]}
    assert _problems(role_eval, debian_container, mine_p, mine_g) == []


@pytest.mark.parametrize(("passwd", "group", "want"), [
    ({"shardstack": ["x", "998", "998"]}, {"shardstack": ["x", "998", ""]},
     ["the account shardstack exists with uid 998, not shardstack_uid 2990",
      "the group shardstack exists with gid 998, not shardstack_gid 2990"]),
    ({"alice": ["x", "2990", "100"]}, {"research": ["x", "2990", ""]},
     ["uid 2990 belongs to the account alice", "gid 2990 belongs to the group research"]),
])
def test_other_ids_are_reported_not_changed(role_eval: Any, debian_container: dict, passwd: dict, group: dict,
                                            want: list[str]) -> None:
    assert _problems(role_eval, debian_container, {**PASSWD, **passwd}, {**GROUP, **group}) == want


def test_ids_given_as_strings_compare_as_numbers(role_eval: Any, debian_container: dict) -> None:
    mine = {**PASSWD, "shardstack": ["x", "3100", "3100"]}
    assert _problems(role_eval, debian_container, mine, GROUP, shardstack_uid="3100", shardstack_gid=3100) == []


def _tasks(path: Path) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text()) or []


def _account_names() -> set[str]:
    """`{{ var }}` of every role variable that defaults to the service account or its group."""
    names = {"{{ shardstack_user }}", "{{ shardstack_group }}"}
    for defaults in ROLES.glob("*/defaults/main.yml"):
        for key, value in (yaml.safe_load(defaults.read_text()) or {}).items():
            if value in ("{{ shardstack_user }}", "{{ shardstack_group }}"):
                names.add("{{ " + key + " }}")
    return names


def test_every_task_that_creates_the_account_pins_its_ids_after_the_check() -> None:
    names = _account_names()
    creators: list[str] = []
    for path in sorted(ROLES.glob("*/tasks/*.yml")):
        tasks = _tasks(path)
        checked = False
        for task in tasks:
            if (task.get("ansible.builtin.include_role") or {}).get("tasks_from") == "service_account.yml":
                checked = True
            for module, key, pinned in (("ansible.builtin.user", "uid", "{{ shardstack_uid }}"),
                                        ("ansible.builtin.group", "gid", "{{ shardstack_gid }}")):
                args = task.get(module)
                if not args or args.get("name") not in names or args.get("state") == "absent":
                    continue
                where = f"{path.relative_to(ROLES)}: {task['name']}"
                creators.append(where)
                assert args.get(key) == pinned, where
                assert checked, f"{where} runs before shardstack_common's service_account.yml"
    assert {c.split(":")[0] for c in creators} == {"os_baseline/tasks/configure.yml",
                                                  "training_runtime/tasks/install.yml"}, creators


def test_the_ids_are_checked_once_per_node_and_account(tmp_path: Path) -> None:
    """os_baseline and training_runtime both include the check; the second include of the same account reads
    nothing again (a deploy's re-run pays for every task it runs on every node)."""
    uid = next(n for n in range(64990, 65500) if not _taken(n))
    inv = tmp_path / "hosts.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": {}}, "vars": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}))
    res = run_playbook("tests/roles/playbooks/service_account.yml", inv, artifacts=tmp_path / "art",
                       extravars={"test_accounts": ["ssck-a", "ssck-a", "ssck-b"], "shardstack_uid": uid,
                                  "shardstack_gid": uid})
    assert res.success, {h: (r.failed_task, r.message) for h, r in res.hosts.items()}
    events = [json.loads(p.read_text()) for p in Path(res.artifact_dir).glob("job_events/*.json")]
    ran = Counter(e["event_data"]["task"] for e in events if e.get("event") == "runner_on_ok")
    assert ran["Service account - accounts on this node"] == 2, ran  # ssck-a once, ssck-b once
    assert ran["Service account - the pinned ids are free or already its own"] == 2, ran
    assert res.changed == 0


def _taken(number: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(number)
        except KeyError:
            continue
        return True
    return False
