"""Filters of shardstack_common: the hardware probe's output as the fact, the distribution's apt sources with
the components the NVIDIA packages need, the primary keys of a repository's signing key file, and what stands in the
way of the service account's pinned ids."""

from __future__ import annotations

import base64
import re
from typing import Any

NVIDIA_VENDOR = "0x10de"
# PCI class codes (sysfs `class`, 0xCCSSPP): 0x03 display controllers (VGA 0x0300, 3D 0x0302) are the GPUs;
# an NVSwitch is an NVIDIA "bridge, other" (0x0680).
GPU_CLASS = re.compile(r"^0x03")
NVSWITCH_CLASS = re.compile(r"^0x0680")


def hardware(lines: list[str]) -> dict[str, list[str]]:
    """The probe's output (tasks/hardware.yml) → the fact `shardstack_hardware`.

    Lines are `<sysfs path>/vendor:0x10de` or `<sysfs path>/class:0x030200` (grep -H) for PCI functions, and bare
    paths for /dev/nvidia<N> and /sys/class/infiniband/<device>. nvidia_pci_functions: the vendor file of every
    NVIDIA function (GPUs, NVSwitches, audio); nvidia_gpu_functions and nvswitch_functions: the device directories
    of the NVIDIA functions of those classes.
    """
    attrs: dict[str, dict[str, str]] = {}
    devnodes, rdma = [], []
    for line in lines:
        if line.startswith("/dev/"):
            devnodes.append(line.strip())
        elif line.startswith("/sys/class/infiniband/"):
            rdma.append(line.strip())
        else:
            path, sep, value = line.rpartition(":")
            device, _, name = path.rpartition("/")
            if sep and name in ("vendor", "class"):
                attrs.setdefault(device, {})[name] = value.strip().lower()
    nvidia = sorted(d for d, a in attrs.items() if a.get("vendor") == NVIDIA_VENDOR)
    return {
        "nvidia_pci_functions": [f"{d}/vendor" for d in nvidia],
        "nvidia_gpu_functions": [d for d in nvidia if GPU_CLASS.match(attrs[d].get("class", ""))],
        "nvswitch_functions": [d for d in nvidia if NVSWITCH_CLASS.match(attrs[d].get("class", ""))],
        "nvidia_device_nodes": sorted(devnodes),
        "rdma_devices": sorted(rdma),
    }


# `deb [options] URI suite component…  # comment`
_ONE_LINE = re.compile(r"^(?P<head>\s*deb(?:-src)?\s+(?:\[[^\]]*\]\s+)?\S+\s+(?P<suite>\S+))"
                       r"(?P<components>(?:\s+[^\s#]+)*)(?P<tail>\s*(?:#.*)?)$")


def _archive(suites: list[str], components: list[str], codename: str) -> bool:
    # The distribution's own archive (any mirror): its codename's suites (bookworm, bookworm-updates, -security) with
    # `main`. Third-party repositories that reuse the codename (Docker's `bookworm stable`) have no `main`.
    return "main" in components and any(s == codename or s.startswith(codename + "-") for s in suites)


def _edit(text: str, codename: str, components: list[str]) -> tuple[str, int]:
    """`text` with `components` added to each entry of the archive, and how many entries it has."""
    entries = 0

    def add(have: list[str]) -> str:
        return " ".join(have + [c for c in components if c not in have])

    out = []
    if re.search(r"^\s*(Types|URIs|Suites):", text, re.M):  # deb822: stanzas separated by blank lines
        for stanza in re.split(r"(\n[ \t]*\n)", text):
            suites = re.search(r"^Suites:[ \t]*(.*)$", stanza, re.M)
            comps = re.search(r"^Components:[ \t]*(.*)$", stanza, re.M)
            disabled = re.search(r"^Enabled:[ \t]*no[ \t]*$", stanza, re.M | re.I)
            if suites and comps and not disabled and _archive(suites[1].split(), comps[1].split(), codename):
                entries += 1
                stanza = f"{stanza[:comps.start()]}Components: {add(comps[1].split())}{stanza[comps.end():]}"
            out.append(stanza)
        return "".join(out), entries
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        m = _ONE_LINE.match(body)
        if m and _archive([m["suite"]], m["components"].split(), codename):
            entries += 1
            body = f"{m['head']} {add(m['components'].split())}{m['tail']}"
        out.append(body + line[len(line.rstrip("\n")):])
    return "".join(out), entries


def apt_components(text: str, codename: str, components: list[str]) -> str:
    """The apt sources `text` (one-line sources.list or deb822 .sources) with `components` added to every entry of
    the distribution's archive for `codename`; everything else, comments and order included, stays as it is."""
    return _edit(text, codename, components)[0]


def _slurped(results: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(path, text) of each file ansible.builtin.slurp read in a loop (absent files have no content)."""
    return [(r["source"], base64.b64decode(r["content"]).decode()) for r in results if r.get("content") is not None]


def apt_entries(results: list[dict[str, Any]], codename: str) -> int:
    """How many entries of the distribution's archive for `codename` the slurped sources files have."""
    return sum(_edit(text, codename, [])[1] for _, text in _slurped(results))


def apt_changes(results: list[dict[str, Any]], codename: str, components: list[str]) -> list[dict[str, str]]:
    """The slurped sources files whose text changes with `components` added: [{"path", "content"}] (the new text)."""
    out = []
    for path, text in _slurped(results):
        new = apt_components(text, codename, components)
        if new != text:
            out.append({"path": path, "content": new})
    return out


def gpg_primary_fingerprints(lines: list[str]) -> list[str]:
    """`gpg --show-keys --with-colons` output → the fingerprint of each primary key, upper case. A `fpr` record
    follows its key's `pub` (or `sub`) record; only the primary keys' count: apt trusts every key in a signed-by
    file, and a subkey is trusted through its primary."""
    out, after_pub = [], False
    for line in lines:
        fields = line.split(":")
        if fields[0] == "fpr" and after_pub and len(fields) > 9:
            out.append(fields[9].upper())
        after_pub = fields[0] == "pub"
    return out


def account_problems(passwd: dict[str, list[str]], groups: dict[str, list[str]], user: str, group: str,
                     uid: Any, gid: Any) -> list[str]:
    """Why the service account cannot be created or kept with the pinned ids on this node, from `getent passwd` and
    `getent group` (ansible_facts.getent_*: name → [password, id, …]); [] when nothing stands in the way. Changing
    the ids of an existing account would orphan its files, so that is the operator's step, never the play's."""
    uid, gid = str(uid), str(gid)
    out = []
    have = (passwd.get(user) or [None, None])[1]
    if have is not None and str(have) != uid:
        out.append(f"the account {user} exists with uid {have}, not shardstack_uid {uid}")
    have = (groups.get(group) or [None, None])[1]
    if have is not None and str(have) != gid:
        out.append(f"the group {group} exists with gid {have}, not shardstack_gid {gid}")
    out += [f"uid {uid} belongs to the account {name}" for name, entry in sorted(passwd.items())
            if name != user and len(entry) > 1 and str(entry[1]) == uid]
    out += [f"gid {gid} belongs to the group {name}" for name, entry in sorted(groups.items())
            if name != group and len(entry) > 1 and str(entry[1]) == gid]
    return out


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"shardstack_hardware_fact": hardware, "shardstack_account_problems": account_problems, "shardstack_apt_entries": apt_entries,
                "shardstack_apt_changes": apt_changes, "shardstack_gpg_primary_fingerprints": gpg_primary_fingerprints}
