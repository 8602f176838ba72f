"""The one sandboxing drop-in template (shardstack_common's templates/hardening.conf.j2, reached through
tasks/hardening.yml): every role's settings render the common baseline, each setting moves only its own directive,
and the settings the task file documents and checks are those the template reads.
tests/ops/test_unit_security.py scores the rendered drop-ins."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_vars import RoleEval

ROLES = Path(__file__).resolve().parents[2] / "roles"
COMMON = ROLES / "shardstack_common"

# Every unit's drop-in: (role, its settings as an expression of the role's variables, unit, overrides).
UNITS = [
    ("grafana", "__grafana_hardening", "grafana-server", {}),
    ("loadbalancer", "__loadbalancer_hardening", "haproxy", {}),
    ("loadbalancer", "__loadbalancer_hardening", "haproxy", {"loadbalancer_access_log": "syslog"}),
    ("munge", "__munge_hardening", "munge", {}),
    ("node_exporter", "__node_exporter_hardening", "prometheus-node-exporter", {}),
    ("prometheus", "__prometheus_hardening[0].settings", "prometheus", {}),
    ("prometheus", "__prometheus_hardening[1].settings", "prometheus-alertmanager", {}),
    ("slurm", "__slurm_hardening", "slurmctld", {}),
    ("slurm", "__slurm_hardening", "slurmdbd", {}),
]
# What every drop-in has, whatever the settings.
BASELINE = {
    "NoNewPrivileges=true", "ProtectSystem=strict", "ProtectHome=true", "PrivateTmp=true",
    "ProtectKernelTunables=true", "ProtectKernelModules=true", "ProtectKernelLogs=true", "ProtectControlGroups=true",
    "ProtectClock=true", "ProtectHostname=true", "RestrictNamespaces=true", "RestrictRealtime=true",
    "RestrictSUIDSGID=true", "LockPersonality=true", "RemoveIPC=true", "SystemCallArchitectures=native",
    "SystemCallFilter=@system-service", "SystemCallErrorNumber=EPERM", "AmbientCapabilities=",
}
# What the settings {} give on top of it.
DEFAULTS = {
    "PrivateDevices=true", "PrivateUsers=true", "PrivateMounts=true", "ProtectProc=invisible",
    "MemoryDenyWriteExecute=true", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "SystemCallFilter=~@privileged", "CapabilityBoundingSet=", "UMask=0077",
}


def directives(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0] == "[Service]", text
    return lines[1:]


def render(settings: dict[str, Any], debian: dict[str, Any]) -> list[str]:
    return directives(RoleEval("shardstack_common", debian, __test_settings=settings)
                      .render_hardening("__test_settings", "test"))


def known_settings() -> list[str]:
    """The settings hardening.yml accepts (its assert's list)."""
    tasks = yaml.safe_load((COMMON / "tasks" / "hardening.yml").read_text())
    return next(t["vars"]["__shardstack_common_hardening_keys"] for t in tasks if "ansible.builtin.assert" in t)


@pytest.mark.parametrize(("role", "settings", "unit", "overrides"), UNITS,
                         ids=[f"{u}{'-' + '-'.join(map(str, o.values())) if o else ''}" for _, _, u, o in UNITS])
def test_every_role_s_drop_in_has_the_baseline(role: str, settings: str, unit: str, overrides: dict[str, Any],
                                               debian_container: dict[str, Any]) -> None:
    ev = RoleEval(role, debian_container, **overrides)
    assert set(ev[settings]) <= set(known_settings()), ev[settings]
    text = ev.render_hardening(settings, unit)
    assert f"# Sandboxing for {unit}.service" in text and f"\n# {role} role, whose vars/main.yml" in text
    lines = directives(text)
    assert set(lines) >= BASELINE, BASELINE - set(lines)
    # Each directive once (SystemCallFilter= adds to the filter), and always a bounding set and address families.
    names = [line.split("=", 1)[0] for line in lines]
    assert all(re.fullmatch(r"[A-Z][A-Za-z]+=\S.*|[A-Z][A-Za-z]+=", line) for line in lines), lines
    assert len(names) == len(set(names)) + names.count("SystemCallFilter") - 1, names
    assert names.count("CapabilityBoundingSet") == names.count("RestrictAddressFamilies") == 1


def test_every_role_s_settings_are_rendered() -> None:
    """A role that adds a __<role>_hardening must add its units above (and to tests/unit_exposure.py's table)."""
    defined = {name for path in ROLES.glob("*/vars/main.yml")
               for name in yaml.safe_load(path.read_text()) or {} if name.endswith("_hardening")}
    assert defined == {re.match(r"\w+", settings)[0] for _, settings, _, _ in UNITS}


def test_defaults(debian_container: dict[str, Any]) -> None:
    assert set(render({}, debian_container)) == BASELINE | DEFAULTS


@pytest.mark.parametrize(("setting", "value", "removed", "added"), [
    ("memory_deny_write_execute", False, {"MemoryDenyWriteExecute=true"}, set()),
    ("private_devices", False, {"PrivateDevices=true"}, {"DevicePolicy=closed"}),
    ("private_users", False, {"PrivateUsers=true"}, set()),
    ("private_mounts", False, {"PrivateMounts=true"}, set()),
    ("protect_proc", False, {"ProtectProc=invisible"}, set()),
    ("proc_subset_pid", True, set(), {"ProcSubset=pid"}),
    ("deny_privileged", False, {"SystemCallFilter=~@privileged"}, set()),
    ("umask", None, {"UMask=0077"}, set()),
    ("umask", "0027", {"UMask=0077"}, {"UMask=0027"}),
    ("read_write_paths", ["-/var/lib/x", "/run"], set(), {"ReadWritePaths=-/var/lib/x /run"}),
    ("address_families", ["AF_UNIX"], {"RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK"},
     {"RestrictAddressFamilies=AF_UNIX"}),
    ("capabilities", ["CAP_KILL", "CAP_CHOWN"], {"CapabilityBoundingSet="},
     {"CapabilityBoundingSet=CAP_KILL CAP_CHOWN"}),
    ("system_call_allow", ["@setuid", "chroot"], set(), {"SystemCallFilter=@setuid chroot"}),
    ("bind_read_only_paths", ["/a:/b"], set(), {"BindReadOnlyPaths=/a:/b"}),
])
def test_a_setting_moves_its_own_directive(setting: str, value: Any, removed: set[str], added: set[str],
                                           debian_container: dict[str, Any]) -> None:
    default = set(render({}, debian_container))
    flipped = render({setting: value}, debian_container)
    assert (default - set(flipped), set(flipped) - default) == (removed, added)
    if setting == "system_call_allow":  # an allow list after the deny list takes those calls back out of it
        assert flipped.index("SystemCallFilter=~@privileged") < flipped.index("SystemCallFilter=@setuid chroot")


def test_the_settings_the_task_file_knows_are_the_template_s() -> None:
    """hardening.yml's assert (a misspelt setting fails the role), its header and the template name the same."""
    template = set(re.findall(r"\bs\.(\w+)", (COMMON / "templates" / "hardening.conf.j2").read_text()))
    tasks = (COMMON / "tasks" / "hardening.yml").read_text()
    documented = set(re.findall(r"^#       (\w+) \[", tasks, re.MULTILINE))
    assert template == documented == set(known_settings())
