"""Controller-side secrets live beside the inventory, must never be read back as inventory, and clients find the
token and the CA certificate where the roles keep them."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible import constants as C
from shardstack.errors import ShardstackError
from shardstack.ops.endpoint import CLUSTER_CA, endpoint, load_ca, load_cluster_ca, load_token
from shardstack.ops.inventory import Cluster

from .conftest import role_value, store_files

ROOT = Path(__file__).resolve().parents[2]


def test_controller_stores_are_ignored_when_the_inventory_is_a_directory(tmp_path: Path) -> None:
    # A directory inventory (molecule's, or `-i inventory/prod/`) is parsed file by file, subdirectories included:
    # a bare token would be read as a host named after the secret, a PEM file as hosts named after key lines.
    stores = [role_value("inference_service", "inference_service_token_store", inventory_dir="/inv"),
              role_value("loadbalancer", "loadbalancer_stats_password_store", inventory_dir="/inv"),
              *map(str, store_files(Path("/inv/credentials"), "lb").values())]
    ignored = C.INVENTORY_IGNORE_EXTS
    assert all(Path(s).parent == Path("/inv/credentials") for s in stores), stores
    assert all(any(s.endswith(ext) for ext in ignored) for s in stores), (stores, ignored)
    assert store_files(Path("/inv/credentials"), "lb")["ca_cert"].name == CLUSTER_CA  # where clients look
    # And for real: an inventory directory holding every one of them still lists just its hosts, and no file in
    # credentials/ is even tried (the directory itself, left empty of sources, only gets a warning).
    inv = tmp_path / "inv"
    (inv / "credentials").mkdir(parents=True)
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": {"n1": {}}}}))
    pem = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQ\n-----END PRIVATE KEY-----\n"
    for s in stores:
        (inv / "credentials" / Path(s).name).write_text(pem)
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(inv), "--list"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "credentials/" not in proc.stderr, proc.stderr
    groups = yaml.safe_load(proc.stdout)
    assert {h for name, g in groups.items() if name != "_meta" for h in g.get("hosts", [])} == {"n1"}


def _inventory(tmp_path: Path, **inference_vars: str) -> Path:
    inv = tmp_path / "inv" / "hosts.yml"
    inv.parent.mkdir()
    inv.write_text(yaml.safe_dump({"all": {"children": {"inference_nodes": {
        "hosts": {"n2": {}, "n3": {}}, "vars": inference_vars}}}}))
    return inv


def test_clients_find_the_token_where_the_role_keeps_it(tmp_path: Path) -> None:
    inv = _inventory(tmp_path)
    assert load_token(Cluster.load(inv)) is None  # nothing deployed yet
    (inv.parent / "credentials").mkdir()
    (inv.parent / "credentials" / "inference-token.txt").write_text("generated\n")  # the role's default store
    assert load_token(Cluster.load(inv)) == "generated"


def test_clients_follow_an_overridden_store_or_an_explicit_token(tmp_path: Path) -> None:
    moved = _inventory(tmp_path, inference_service_token_store="{{ inventory_dir }}/secrets/token.txt")
    (moved.parent / "secrets").mkdir()
    (moved.parent / "secrets" / "token.txt").write_text("moved\n")
    assert load_token(Cluster.load(moved)) == "moved"
    (tmp_path / "other").mkdir()
    explicit = _inventory(tmp_path / "other", inference_service_token="set-in-inventory")
    assert load_token(Cluster.load(explicit)) == "set-in-inventory"


def test_a_store_path_with_other_jinja_is_a_clear_error(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, inference_service_token_store="{{ lookup('env', 'HOME') }}/t.txt")
    with pytest.raises(ShardstackError, match="set a plain path"):
        load_token(Cluster.load(inv))


def test_clients_read_cluster_settings_as_the_roles_do(tmp_path: Path) -> None:
    inv = tmp_path / "hosts.yml"
    inv.write_text(yaml.safe_dump({"all": {"children": {
        "train_nodes": {"hosts": {"n1": {}}, "vars": {"shardstack_shared_dir": "/data/shared"}},
        "loadbalancer": {"hosts": {"n1": {}}, "vars": {"loadbalancer_port": "{{ 8000 + 80 }}"}}}}}))
    found = Cluster.load(inv)
    assert found.shared_dir == "/data/shared"  # the inventory's value wins
    assert found.setting("training_runtime_venv", "training_runtime", "train_nodes") == "/opt/shardstack/venv"
    with pytest.raises(ShardstackError, match=r"loadbalancer_port=.*is a template"):
        found.setting("loadbalancer_port", "loadbalancer", "loadbalancer")


def _lb_inventory(tmp_path: Path, **lb_vars: object) -> Path:
    inv = tmp_path / "inv" / "hosts.yml"
    inv.parent.mkdir(parents=True)
    inv.write_text(yaml.safe_dump({"all": {"children": {
        "inference_nodes": {"hosts": {"n2": {}}},
        "loadbalancer": {"hosts": {"n1": {"ansible_host": "10.0.0.1"}}, "vars": lb_vars}}}}))
    return inv


def test_clients_find_the_ca_where_the_role_keeps_it(tmp_path: Path) -> None:
    inv = _lb_inventory(tmp_path)
    assert load_ca(Cluster.load(inv)) == inv.parent / "credentials" / CLUSTER_CA
    ep = endpoint(Cluster.load(inv))
    assert (ep.url, ep.token, ep.cafile) == ("https://10.0.0.1", None, inv.parent / "credentials" / CLUSTER_CA)
    # Not deployed yet: the first request says so in one line, without a traceback.
    with pytest.raises(ShardstackError, match=r"(?s)no CA certificate at .*deploy it first"):
        ep.call("GET", "/health")


def test_clients_follow_an_overridden_ca_store_port_or_certificate(tmp_path: Path) -> None:
    moved = _lb_inventory(tmp_path / "a", loadbalancer_tls_store="{{ inventory_dir }}/pki", loadbalancer_tls_port=8443)
    assert load_ca(Cluster.load(moved)) == moved.parent / "pki" / CLUSTER_CA
    assert endpoint(Cluster.load(moved)).url == "https://10.0.0.1:8443"
    named = _lb_inventory(tmp_path / "b", loadbalancer_tls_cert="/pki/lb.crt", loadbalancer_tls_key="/pki/lb.key",
                          loadbalancer_tls_ca="/pki/ca.crt")
    assert load_ca(Cluster.load(named)) == Path("/pki/ca.crt")
    public = _lb_inventory(tmp_path / "c", loadbalancer_tls_cert="/pki/lb.crt", loadbalancer_tls_key="/pki/lb.key")
    assert load_ca(Cluster.load(public)) is None  # an own certificate without a CA named: the system's trust store
    # The backends' certificates always come from the cluster CA, whatever the edge's certificate.
    assert load_cluster_ca(Cluster.load(public)) == public.parent / "credentials" / CLUSTER_CA
    assert load_cluster_ca(Cluster.load(named)) == named.parent / "credentials" / CLUSTER_CA
    assert load_cluster_ca(Cluster.load(moved)) == moved.parent / "pki" / CLUSTER_CA
