"""Helpers for the ops tests: render a role's templates with Ansible's own Templar, as the role would, and issue
certificates with the loadbalancer role's own module, into files named as the role names them."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from ansible_vars import load_module, load_vars, trusted

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"


def _templar(role: str, variables: dict[str, Any]) -> Templar:
    layered = {**load_vars(ROLES / role / "defaults" / "main.yml"), **load_vars(ROLES / role / "vars" / "main.yml"),
               "ansible_managed": "Ansible managed", **variables}
    return Templar(loader=DataLoader(), variables=trusted(layered))


def render(role: str, template: str, **variables: Any) -> str:
    """Render roles/<role>/templates/<template> with the role's defaults and vars, overridden by `variables`."""
    return _templar(role, variables).template(trust_as_template((ROLES / role / "templates" / template).read_text()))


def role_value(role: str, expression: str, **variables: Any) -> Any:
    """`{{ expression }}` as the role evaluates it with these variables."""
    return _templar(role, variables).template(trust_as_template("{{ " + expression + " }}"))


def certificate_module() -> ModuleType:
    """roles/shardstack_common/library/cluster_certificate.py, imported as the module Ansible runs."""
    return load_module(ROLES / "shardstack_common" / "library" / "cluster_certificate.py")


def store_files(store: Path, host: str) -> dict[str, Path]:
    """The CA and `host`'s certificate in a loadbalancer_tls_store, by the names the role gives them."""
    names = {"ca_cert": "__loadbalancer_ca_cert", "ca_key": "__loadbalancer_ca_key", "cert": "__loadbalancer_cert",
             "key": "__loadbalancer_key"}
    return {k: Path(role_value("loadbalancer", v, loadbalancer_tls_store=str(store), inventory_hostname=host))
            for k, v in names.items()}


def issue(store: Path, host: str, names: list[str], **options: Any) -> dict[str, Path]:
    """The cluster CA (once) and a certificate for `host`, as the role's module issues them."""
    cc, files = certificate_module(), store_files(store, host)
    plan = cc.plan(*files.values(), names, renew_days=options.pop("renew_days", 30))
    cc.apply(plan, *files.values(), names, ca_common_name="test cluster CA", valid_days=options.pop("valid_days", 90))
    return files
