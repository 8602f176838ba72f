"""Controller-side secrets live beside the inventory, must never be read back as inventory, and clients find the
token where the inference_service role keeps it."""

from pathlib import Path

import pytest
import yaml
from ansible import constants as C
from shardstack.errors import ShardstackError
from shardstack.ops.cluster import load_token

ROOT = Path(__file__).resolve().parents[2]


def test_token_store_is_ignored_when_the_inventory_is_a_directory() -> None:
    # A directory inventory (molecule's, or `-i inventory/prod/`) is parsed file by file; a bare token would be
    # read as a host named after the secret.
    store = yaml.safe_load((ROOT / "roles/inference_service/defaults/main.yml").read_text())[
        "inference_service_token_store"]
    ignored = C.INVENTORY_IGNORE_EXTS
    assert any(store.endswith(ext) for ext in ignored), (store, ignored)


def _inventory(tmp_path: Path, **inference_vars: str) -> Path:
    inv = tmp_path / "inv" / "hosts.yml"
    inv.parent.mkdir()
    inv.write_text(yaml.safe_dump({"all": {"children": {"inference_nodes": {
        "hosts": {"n2": {}, "n3": {}}, "vars": inference_vars}}}}))
    return inv


def test_clients_find_the_token_where_the_role_keeps_it(tmp_path: Path) -> None:
    inv = _inventory(tmp_path)
    assert load_token(inv) is None  # nothing deployed yet
    (inv.parent / "credentials").mkdir()
    (inv.parent / "credentials" / "inference-token.txt").write_text("generated\n")  # the role's default store
    assert load_token(inv) == "generated"


def test_clients_follow_an_overridden_store_or_an_explicit_token(tmp_path: Path) -> None:
    moved = _inventory(tmp_path, inference_service_token_store="{{ inventory_dir }}/secrets/token.txt")
    (moved.parent / "secrets").mkdir()
    (moved.parent / "secrets" / "token.txt").write_text("moved\n")
    assert load_token(moved) == "moved"
    (tmp_path / "other").mkdir()
    explicit = _inventory(tmp_path / "other", inference_service_token="set-in-inventory")
    assert load_token(explicit) == "set-in-inventory"


def test_a_store_path_with_other_jinja_is_a_clear_error(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, inference_service_token_store="{{ lookup('env', 'HOME') }}/t.txt")
    with pytest.raises(ShardstackError, match="set a plain path"):
        load_token(inv)


def test_clients_read_cluster_settings_as_the_roles_do(tmp_path: Path) -> None:
    from shardstack.ops.cluster import inventory_hosts, setting, shared_dir

    inv = tmp_path / "hosts.yml"
    inv.write_text(yaml.safe_dump({"all": {"children": {
        "train_nodes": {"hosts": {"n1": {}}, "vars": {"shardstack_shared_dir": "/data/shared"}},
        "loadbalancer": {"hosts": {"n1": {}}, "vars": {"loadbalancer_port": "{{ 8000 + 80 }}"}}}}}))
    found = inventory_hosts(inv)
    assert shared_dir(found) == "/data/shared"  # the inventory's value wins
    assert setting(found, "training_runtime_venv", "training_runtime", "train_nodes") == "/opt/shardstack/venv"
    with pytest.raises(ShardstackError, match=r"loadbalancer_port=.*is a template"):
        setting(found, "loadbalancer_port", "loadbalancer", "loadbalancer")
