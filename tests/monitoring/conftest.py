"""Helpers for the monitoring tests: the repo's paths, promtool/amtool, and role templating without a host.

Role variables are evaluated by tests/ansible_vars.RoleEval (Ansible's own Templar), so the templates under test
are exactly what the roles write on a node.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from ansible_vars import RoleEval, load_module

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"
RULES_DIR = ROLES / "prometheus" / "files" / "rules"
RULE_TESTS_DIR = Path(__file__).resolve().parent / "rules"
DASHBOARDS_DIR = ROLES / "grafana" / "files" / "dashboards"

FACTS: dict[str, Any] = {
    "architecture": "x86_64",
    "os_family": "Debian",
    "distribution": "Debian",
    "distribution_major_version": "12",
    "distribution_version": "12.8",
    "virtualization_type": "container",
}


def tool(name: str) -> str:
    """Path of promtool/amtool; their absence is a setup error, not a reason to skip."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: apt-get install prometheus prometheus-alertmanager (Debian)")
    return path


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120)


def load_filter_module() -> ModuleType:
    """The prometheus role's filter plugin."""
    return load_module(ROLES / "prometheus" / "filter_plugins" / "prometheus_targets.py")


def role_vars(role: str, **overrides: Any) -> RoleEval:
    """One role's variable namespace for an imaginary Debian 12 container."""
    return RoleEval(role, FACTS, **overrides)
