"""shardstack_common: the one home of what the roles share — the CUDA repository and its architecture, the hardware
fact, the OS-variables preamble with its failure on an unsupported OS, and the shared paths and service account."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_vars import dependencies, load_module, load_vars

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"
UBUNTU = {"distribution": "Ubuntu", "distribution_version": "22.04", "distribution_major_version": "22"}
ROCKY = {"distribution": "Rocky", "os_family": "RedHat", "distribution_version": "9.4",
         "distribution_major_version": "9"}


@pytest.mark.parametrize(
    ("facts", "arch", "repo"),
    [
        ({}, "x86_64", "debian12/x86_64"),
        ({"architecture": "aarch64"}, "sbsa", "debian12/sbsa"),
        (UBUNTU, "x86_64", "ubuntu2204/x86_64"),
        ({**ROCKY, "architecture": "aarch64"}, "sbsa", "rhel9/sbsa"),
    ],
)
def test_cuda_repository_distro_and_arch(
    role_eval: Any, debian_container: dict, facts: dict, arch: str, repo: str
) -> None:
    r = role_eval("shardstack_common", {**debian_container, **facts})
    assert r["__shardstack_common_cuda_arch"] == arch
    assert r["__shardstack_common_cuda_repo"] == f"https://developer.download.nvidia.com/compute/cuda/repos/{repo}"
    mirror = role_eval("shardstack_common", {**debian_container, **facts}, shardstack_cuda_repo_url="http://mirror/cuda")
    assert mirror["__shardstack_common_cuda_repo"] == f"http://mirror/cuda/{repo}"


def _filters() -> Any:
    return load_module(ROLES / "shardstack_common" / "filter_plugins" / "shardstack_common.py")


# The probe (tasks/hardware.yml) on an HGX H100 node: 8 GPUs (3D controllers), 4 NVSwitches (bridge, other), the
# BMC's VGA (ASPEED, class 0x03 of another vendor), a ConnectX-7, device nodes and InfiniBand devices.
HGX = [
    *(line for i, bus in enumerate(["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]) for line in (
        f"/sys/bus/pci/devices/0000:{bus}:00.0/vendor:0x10de", f"/sys/bus/pci/devices/0000:{bus}:00.0/class:0x030200")),
    *(line for bus in ["05", "06", "07", "08"] for line in (
        f"/sys/bus/pci/devices/0000:{bus}:00.0/vendor:0x10de", f"/sys/bus/pci/devices/0000:{bus}:00.0/class:0x068000")),
    "/sys/bus/pci/devices/0000:03:00.0/vendor:0x1a03", "/sys/bus/pci/devices/0000:03:00.0/class:0x030000",
    "/sys/bus/pci/devices/0000:1a:00.0/vendor:0x15b3", "/sys/bus/pci/devices/0000:1a:00.0/class:0x020700",
    *(f"/dev/nvidia{i}" for i in range(8)),
    "/sys/class/infiniband/mlx5_0", "/sys/class/infiniband/mlx5_1",
]


def test_hardware_fact_from_the_probe() -> None:
    fact = _filters().hardware(HGX)
    assert len(fact["nvidia_pci_functions"]) == 12 and all(p.endswith("/vendor") for p in fact["nvidia_pci_functions"])
    assert len(fact["nvidia_gpu_functions"]) == 8
    assert "/sys/bus/pci/devices/0000:18:00.0" in fact["nvidia_gpu_functions"]
    assert fact["nvswitch_functions"] == [f"/sys/bus/pci/devices/0000:0{i}:00.0" for i in (5, 6, 7, 8)]
    assert fact["nvidia_device_nodes"] == [f"/dev/nvidia{i}" for i in range(8)]
    assert fact["rdma_devices"] == ["/sys/class/infiniband/mlx5_0", "/sys/class/infiniband/mlx5_1"]
    # A node without NVIDIA functions (the BMC's VGA is not a GPU of ours), and one without a PCI bus in sysfs.
    cpu = _filters().hardware(HGX[-14:-10])
    assert cpu == {"nvidia_pci_functions": [], "nvidia_gpu_functions": [], "nvswitch_functions": [],
                   "nvidia_device_nodes": [], "rdma_devices": []}
    assert _filters().hardware([]) == cpu


DEBOOTSTRAP = "deb http://deb.debian.org/debian bookworm main\n"
INSTALLER = """\
# deb cdrom:[Debian GNU/Linux 12.8.0 _Bookworm_]/ bookworm main non-free-firmware
deb http://ftp.de.debian.org/debian/ bookworm main non-free-firmware
deb-src http://ftp.de.debian.org/debian/ bookworm main non-free-firmware

deb http://security.debian.org/debian-security bookworm-security main non-free-firmware  # security
deb http://ftp.de.debian.org/debian/ bookworm-updates main non-free-firmware
deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] https://download.docker.com/linux/debian bookworm stable
deb http://deb.debian.org/debian bookworm-backports main
"""
DEB822 = """\
Types: deb
URIs: http://mirror.example.com/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example.com/debian-security
Suites: bookworm-security
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://mirror.example.com/debian
Suites: bookworm
Components: main
Enabled: no
"""
NVIDIA = ["contrib", "non-free", "non-free-firmware"]


def test_apt_components_added_to_the_archive_entries_only() -> None:
    f = _filters()
    assert f.apt_components(DEBOOTSTRAP, "bookworm", NVIDIA) == (
        "deb http://deb.debian.org/debian bookworm main contrib non-free non-free-firmware\n")
    out = f.apt_components(INSTALLER, "bookworm", NVIDIA).splitlines()
    assert out[0].startswith("# deb cdrom:")  # comments untouched
    assert out[1] == "deb http://ftp.de.debian.org/debian/ bookworm main non-free-firmware contrib non-free"
    assert out[2] == "deb-src http://ftp.de.debian.org/debian/ bookworm main non-free-firmware contrib non-free"
    assert out[4] == ("deb http://security.debian.org/debian-security bookworm-security main non-free-firmware "
                      "contrib non-free  # security")
    # Docker's repository reuses the codename but has no `main`: left alone.
    assert out[6] == INSTALLER.splitlines()[6]
    assert out[7] == "deb http://deb.debian.org/debian bookworm-backports main contrib non-free non-free-firmware"
    stanzas = f.apt_components(DEB822, "bookworm", NVIDIA).split("\n\n")
    assert "\nComponents: main contrib non-free non-free-firmware\n" in stanzas[0]
    assert "\nComponents: main contrib non-free non-free-firmware\n" in stanzas[1]
    assert stanzas[2] == DEB822.split("\n\n")[2]  # disabled: untouched
    ubuntu = "deb http://archive.ubuntu.com/ubuntu jammy main restricted\n"
    assert f.apt_components(ubuntu, "jammy", ["restricted", "multiverse"]) == (
        "deb http://archive.ubuntu.com/ubuntu jammy main restricted multiverse\n")
    # Another release's entries are not this node's archive.
    assert f.apt_components(DEBOOTSTRAP, "trixie", NVIDIA) == DEBOOTSTRAP


def _slurped(**files: str) -> list[dict[str, Any]]:
    """What ansible.builtin.slurp registers in a loop: content for the files that exist, a failure for the others."""
    return [{"source": path, "content": base64.b64encode(text.encode()).decode()} if text is not None
            else {"source": path, "failed": True, "msg": "file not found"} for path, text in files.items()]


def test_apt_changes_are_idempotent_and_count_the_entries() -> None:
    f = _filters()
    read = _slurped(**{"/etc/apt/sources.list": INSTALLER, "/etc/apt/sources.list.d/debian.sources": None})
    assert f.apt_entries(read, "bookworm") == 5
    changes = f.apt_changes(read, "bookworm", NVIDIA)
    assert [c["path"] for c in changes] == ["/etc/apt/sources.list"]
    again = _slurped(**{"/etc/apt/sources.list": changes[0]["content"], "/etc/apt/sources.list.d/debian.sources": None})
    assert f.apt_changes(again, "bookworm", NVIDIA) == []
    # Nothing of the archive configured: no entry, and the role's assert stops the node instead of guessing.
    assert f.apt_entries(_slurped(**{"/etc/apt/sources.list": "# empty\n"}), "bookworm") == 0


SHARED_DIR_USERS = {  # role: variable -> what it is given shardstack_shared_dir=/data/shared
    "shared_storage": {"shared_storage_mount_point": "/data/shared"},
    "training_runtime": {"training_runtime_shared_dir": "/data/shared"},
    "inference_service": {"inference_service_model_dir": "/data/shared/exports/current"},
    "prometheus": {"prometheus_checkpoint_mountpoints": ["/data/shared"]},
}
ACCOUNT_USERS = {
    "os_baseline": ("os_baseline_service_user", "os_baseline_service_group"),
    "shared_storage": ("shared_storage_owner", "shared_storage_group"),
    "training_runtime": ("training_runtime_user", "training_runtime_group"),
    "inference_service": ("inference_service_user", "inference_service_group"),
}


@pytest.mark.parametrize("role", sorted(SHARED_DIR_USERS))
def test_shared_dir_flows_into_the_roles(role_eval: Any, debian_container: dict, role: str) -> None:
    for name, want in SHARED_DIR_USERS[role].items():
        default = role_eval(role, debian_container)[name]
        assert default == (
            [w.replace("/data/shared", "/srv/shardstack") for w in want]
            if isinstance(want, list)
            else want.replace("/data/shared", "/srv/shardstack")
        )
        assert role_eval(role, debian_container, shardstack_shared_dir="/data/shared")[name] == want
    # The role's own variable still wins over the shared one.
    name = next(iter(SHARED_DIR_USERS[role]))
    assert role_eval(role, debian_container, shardstack_shared_dir="/data/shared", **{name: "/x"})[name] == "/x"


@pytest.mark.parametrize("role", sorted(ACCOUNT_USERS))
def test_service_account_flows_into_the_roles(role_eval: Any, debian_container: dict, role: str) -> None:
    user, group = ACCOUNT_USERS[role]
    r = role_eval(role, debian_container)
    assert (r[user], r[group]) == ("shardstack", "shardstack")
    r = role_eval(role, debian_container, shardstack_user="svc", shardstack_group="ml")
    assert (r[user], r[group]) == ("svc", "ml")


def test_mount_unit_follows_the_shared_dir(role_eval: Any, debian_container: dict) -> None:
    r = role_eval(
        "shared_storage",
        debian_container,
        shardstack_shared_dir="/data/shared",
        shared_storage_backend="bind",
        shared_storage_bind_source="/mnt/lab-shared",
    )
    assert r["__shared_storage_unit"] == "data-shared.mount"
    assert "Where=/data/shared" in r.render("shared.mount.j2").splitlines()


def _role_text(role: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(role.rglob("*")) if p.is_file() and p.suffix in {".yml", ".j2"})


SHARED_NAMES = set(load_vars(ROLES / "shardstack_common" / "defaults" / "main.yml"))


@pytest.mark.parametrize("role", sorted(p.name for p in ROLES.iterdir() if p.name != "shardstack_common"))
def test_a_role_that_uses_a_shared_variable_depends_on_shardstack_common(role: str) -> None:
    """Its defaults come from the dependency, so the role also runs on its own (molecule, include_role)."""
    used = {n for n in SHARED_NAMES if re.search(rf"\b{n}\b", _role_text(ROLES / role))}
    deps = [d.name for d in dependencies(ROLES / role)]
    assert not used or "shardstack_common" in deps, f"{role} uses {sorted(used)} without depending on shardstack_common"


# Each concern has one home: these snippets appear in the code of roles/shardstack_common only (comments and
# meta/ descriptions aside), nowhere in another role or in playbooks/.
ONE_HOME = {
    "the sbsa architecture expression": "'sbsa'",
    "the CUDA repository's signing key": "shardstack_cuda_repo_key_fingerprints",
    "the CUDA dnf repository": "ansible.builtin.yum_repository",
    "the OS-variables lookup": "first_found",
    "the PCI probe": '"/sys/bus/pci/devices/*/vendor"',
    "the device-node probe": '"/dev/nvidia[0-9]+"',
    "the InfiniBand probe": '"/sys/class/infiniband/*"',
    "the apt components edit": "shardstack_apt_changes",
    "the shared directory": "/srv/shardstack",
}


def _code_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]


@pytest.mark.parametrize("concern", sorted(ONE_HOME))
def test_one_home_per_concern(concern: str) -> None:
    snippet = ONE_HOME[concern]
    dirs = ("defaults", "handlers", "tasks", "templates", "vars")
    code = [p for d in dirs for p in ROLES.glob(f"*/{d}/**/*") if p.is_file()] + [*(REPO / "playbooks").glob("*.yml")]
    homes = sorted(str(p.relative_to(REPO)) for p in code if any(snippet in line for line in _code_lines(p)))
    assert homes, f"{concern}: {snippet!r} is gone altogether"
    assert all(h.startswith("roles/shardstack_common/") for h in homes), f"{concern} is copied: {homes}"


# --- the task files on a real host (this machine, local connection): read-only probes, no package is installed ---


def _play(tmp_path: Path, tasks: list[dict], roles: dict[str, dict[str, str]] | None = None,
          env: dict[str, str] | None = None) -> str:
    """Run one play on localhost with the repository's roles (and `roles`, written under tmp_path) on the path."""
    for name, files in (roles or {}).items():
        for rel, text in files.items():
            (tmp_path / "roles" / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "roles" / name / rel).write_text(text)
    play = [{"name": "Test", "hosts": "localhost", "gather_facts": True, "tasks": tasks}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    env = {
        **os.environ,
        **(env or {}),
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": f"{tmp_path / 'roles'}:{ROLES}",
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path / "facts"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
    }
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    return proc.stdout + proc.stderr


def test_the_project_config_runs_a_hosts_modules_in_one_interpreter(tmp_path: Path) -> None:
    # ansible.cfg's strategy (Mitogen's linear): every module of a play runs in the one Python that Mitogen keeps
    # per host, so two commands share their parent; Ansible's own linear starts a Python per module (the contrast
    # shows the probe tells the two apart).
    tasks = [{"name": f"Parent {i}", "ansible.builtin.command": "sh -c 'echo $PPID'", "register": f"p{i}",
              "changed_when": False} for i in (1, 2)]
    tasks.append({"name": "Parents", "ansible.builtin.debug": {"msg": "parents={{ p1.stdout }},{{ p2.stdout }}"}})

    def parents(out: str) -> tuple[str, str]:
        found = re.search(r"parents=(\d+),(\d+)", out)
        assert found and "failed=0" in out, out
        return found[1], found[2]

    (tmp_path / "mitogen").mkdir()
    (tmp_path / "linear").mkdir()
    first, second = parents(_play(tmp_path / "mitogen", tasks))
    assert first == second
    first, second = parents(_play(tmp_path / "linear", tasks, env={"ANSIBLE_STRATEGY": "linear"}))
    assert first != second


FORKED_WORKER = """
import gc, importlib.util, os, sys
spec = importlib.util.spec_from_file_location("strategy", sys.argv[1])
strategy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(strategy)
if sys.argv[2] == "prepared":
    strategy.prepare_to_fork()
from ansible.plugins.loader import filter_loader
if os.fork() == 0:  # what a task's worker does at its first filter
    before = set(sys.modules)
    filter_loader.get("ansible.builtin.bool")
    print(sorted(m for m in set(sys.modules) - before if m.startswith("ansible.plugins.")), gc.get_freeze_count() > 0)
    os._exit(0)
os.wait()
"""


@pytest.mark.parametrize(("mode", "imported", "frozen"), [("prepared", False, True), ("as is", True, False)])
def test_the_strategy_forks_workers_with_the_jinja_plugins_loaded(mode: str, imported: bool, frozen: bool) -> None:
    # Each worker would otherwise import every filter plugin file again (~12 s of a 3-node re-run, bench/RESULTS.md).
    proc = subprocess.run(
        [sys.executable, "-c", FORKED_WORKER, str(REPO / "plugins/strategy/mitogen_linear.py"), mode],
        capture_output=True, text=True, timeout=120, check=True,
    )
    modules, freeze = proc.stdout.rsplit(" ", 1)
    assert (modules != "[]") is imported, proc.stdout
    assert freeze.strip() == str(frozen), proc.stdout


WIDGET_MAIN = yaml.safe_dump(
    [
        {"name": "OS variables", "ansible.builtin.import_role": {"name": "shardstack_common",
                                                                 "tasks_from": "os_vars.yml"}},
        {"name": "Show", "ansible.builtin.debug": {"msg": "widget_os={{ __widget_os }}"}},
    ]
)


def test_unsupported_os_fails_naming_the_family_and_what_is_supported(tmp_path: Path) -> None:
    roles = {"widget": {"tasks/main.yml": WIDGET_MAIN, "vars/Plan9.yml": "__widget_os: plan9\n",
                        "vars/Solaris.yml": "__widget_os: solaris\n", "vars/main.yml": "__widget_x: 1\n"}}
    out = _play(tmp_path, [{"name": "Widget", "ansible.builtin.include_role": {"name": "widget"}}], roles)
    assert "failed=1" in out, out
    msg = re.search(r'"msg": "(widget does not support .*?)"', out)
    assert msg, out
    assert re.search(r"\(OS family \w+\): it has variables for Plan9, Solaris only \(roles/widget/vars/;", msg[1])
    assert "widget_os=" not in out


def test_roles_run_alone_probe_the_hardware_once(tmp_path: Path) -> None:
    """Three gated roles' preflights (read-only; they load their vars/Debian.yml) in one play: the first probes the
    hardware, the others reuse the fact."""
    tasks = [
        {"name": f"{role} preflight", "ansible.builtin.include_role": {"name": role, "tasks_from": "preflight.yml"}}
        for role in ("rdma", "nccl", "dcgm_exporter")
    ] + [{"name": "Show", "ansible.builtin.debug": {"msg": "hardware={{ shardstack_hardware | to_json }}"}}]
    out = _play(tmp_path, tasks)
    assert "failed=0" in out, out
    probe = "TASK [shardstack_common : Hardware - probe PCI functions, GPU device nodes and RDMA devices"
    assert out.count(probe) == 1, out
    assert re.search(r'hardware=\{\\"nvidia_pci_functions\\": \[', out), out
    assert re.search(r'\\"nvswitch_functions\\": \[', out), out
    assert re.search(r"rdma: (skipped|userspace)", out) and re.search(r"nccl: library", out), out


@pytest.mark.parametrize(
    ("host", "connection"),
    [({}, "ansible.builtin.ssh"), ({"ansible_connection": "ssh"}, "ansible.builtin.ssh"),
     ({"ansible_connection": "local"}, "local"), ({"ansible_connection": "community.docker.docker"},
                                                 "community.docker.docker")],
)
def test_a_wheelhouse_archive_is_copied_over_ssh_where_the_host_is_reached_over_ssh(
    role_eval: Any, debian_container: dict, host: dict, connection: str
) -> None:
    # The fully qualified name is not one Mitogen's strategy redirects to its own (slower) file transfer.
    r = role_eval("shardstack_common", debian_container, hostvars={"node1": host})
    assert r["__shardstack_common_bulk_connection"] == connection
    copies = []
    for tasks in ("training_runtime/tasks/venv.yml", "inference_service/tasks/vllm.yml"):
        for task in _flat_tasks(yaml.safe_load((ROLES / tasks).read_text())):
            if str(task.get("ansible.builtin.copy", {}).get("src", "")).endswith("wheelhouse.tar"):
                copies.append(task.get("vars", {}).get("ansible_connection"))
    assert copies == ["{{ __shardstack_common_bulk_connection }}"] * 2


def _flat_tasks(tasks: list[dict]) -> list[dict]:
    return [t for task in tasks for t in [task, *_flat_tasks(task.get("block", []) + task.get("rescue", []))]]
