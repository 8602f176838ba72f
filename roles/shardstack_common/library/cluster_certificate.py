#!/usr/bin/python
"""The cluster CA and one server or client certificate issued by it, kept as files on the controller.

Shared by the roles that speak TLS inside the cluster (the loadbalancer's HTTPS edge, the journal's mutual TLS
between systemd-journal-upload and systemd-journal-remote): they list shardstack_common under `dependencies`, which
puts this library/ on their module path.

Python's `cryptography` (a dependency of ansible-core, so present wherever Ansible runs) builds and signs the
certificates; this module only decides *when*: the CA once, the host's key once, its certificate whenever it is
missing, names other hosts than it should, is for another use (server/client), expires within `renew_days`, or was
not signed by the current CA. So a re-run changes nothing, a new load-balancer name re-issues, and check mode says
what would happen and writes nothing. Results hold paths and reasons, never key material.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DOCUMENTATION = r"""
module: cluster_certificate
short_description: A cluster CA and a server or client certificate it signs, as files on the controller
description:
  - Creates the CA (key and self-signed certificate) when neither file exists, and the server key when it is
    missing; (re-)issues the server certificate when it is missing, its subject alternative names differ from
    O(names), its extended key usage is not O(usage), it expires within O(renew_days) days, or the CA did not sign
    it. Supports check mode.
  - Without O(cert), O(key) and O(names), only the CA (for a role that verifies peers and is issued nothing).
options:
  ca_cert: {description: CA certificate (PEM)., type: path, required: true}
  ca_key: {description: CA private key (PEM, 0600)., type: path, required: true}
  cert: {description: Server certificate (PEM)., type: path}
  key: {description: Server private key (PEM, 0600)., type: path}
  names: {description: DNS names and IP addresses the certificate is valid for; the first is its subject., type: list,
          elements: str}
  usage: {description: "What the certificate is for: TLS server, TLS client, or both (extended key usage).",
          type: str, choices: [server, client, both], default: server}
  ca_common_name: {description: The CA's subject., type: str, default: shardstack cluster CA}
  valid_days: {description: Server certificate lifetime., type: int, default: 397}
  renew_days: {description: Re-issue when fewer days are left., type: int, default: 30}
"""

RETURN = r"""
reasons: {description: What was (or in check mode would be) created or re-issued, and why., type: list}
not_after: {description: Expiry of the server certificate (ISO 8601), when there is one., type: str}
"""

CA_DAYS = 3650
DAY = datetime.timedelta(days=1)
USAGES = ("server", "client", "both")


@dataclass
class Plan:
    reasons: list[str] = field(default_factory=list)
    new_ca: bool = False
    new_key: bool = False
    issue: bool = False


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def canonical(name: str) -> str:
    """One spelling per name, as it reads back from a certificate: `2001:DB8::1` is `2001:db8::1`."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name.lower()


def _general_names(names: list[str]) -> list:
    from cryptography import x509

    out = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def _san_set(cert) -> set[str]:
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n.value) for n in san}


def _usage_oids(usage: str) -> set:
    from cryptography.x509.oid import ExtendedKeyUsageOID

    return {"server": {ExtendedKeyUsageOID.SERVER_AUTH}, "client": {ExtendedKeyUsageOID.CLIENT_AUTH},
            "both": {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}}[usage]


def _eku_set(cert) -> set:
    from cryptography import x509

    try:
        return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return set()


def _load_cert(path: Path):
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes())


def _load_key(path: Path):
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_private_key(path.read_bytes(), password=None)


def plan_ca(ca_cert: Path, ca_key: Path) -> Plan:
    """Whether the CA has to be created."""
    p = Plan()
    if ca_cert.exists() != ca_key.exists():
        have, missing = (ca_cert, ca_key) if ca_cert.exists() else (ca_key, ca_cert)
        raise ValueError(f"{have} exists but {missing} does not: restore it, or remove both to create a new CA "
                         "(clients must then trust the new CA certificate)")
    if not ca_cert.exists():
        p.new_ca = True
        p.reasons.append(f"new cluster CA: {ca_cert}")
    return p


def plan(ca_cert: Path, ca_key: Path, cert: Path, key: Path, names: list[str], *, renew_days: int,
         usage: str = "server") -> Plan:
    """What has to be created or re-issued, with a reason each."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    p = plan_ca(ca_cert, ca_key)
    if not key.exists():
        p.new_key = True
        p.reasons.append(f"new {_role(usage)} key: {key}")
    if p.new_ca or p.new_key or not cert.exists():
        p.issue = True
        p.reasons.append(f"new {_role(usage)} certificate for {', '.join(names)}: {cert}")
        return p
    current, issuer = _load_cert(cert), _load_cert(ca_cert)
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if _san_set(current) != set(names):
        p.reasons.append(f"re-issue {cert}: names {sorted(_san_set(current))} -> {sorted(set(names))}")
    elif _eku_set(current) != _usage_oids(usage):
        p.reasons.append(f"re-issue {cert}: not a {_role(usage)} certificate")
    elif current.not_valid_after_utc - _now() < renew_days * DAY:
        p.reasons.append(f"re-issue {cert}: expires {current.not_valid_after_utc.isoformat()}")
    elif current.public_key().public_bytes(serialization.Encoding.PEM, pub) != \
            _load_key(key).public_key().public_bytes(serialization.Encoding.PEM, pub):
        p.reasons.append(f"re-issue {cert}: it does not belong to {key}")
    else:
        try:
            current.verify_directly_issued_by(issuer)
        except (ValueError, TypeError, InvalidSignature):
            p.reasons.append(f"re-issue {cert}: not signed by the CA in {ca_cert}")
    p.issue = bool(p.reasons)
    return p


def _role(usage: str) -> str:
    return {"server": "server", "client": "client", "both": "server and client"}[usage]


def _write(path: Path, data: bytes, mode: int) -> None:
    """Atomically, with its final mode from the start: a key is never readable by others, not even briefly."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(k) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                           serialization.NoEncryption())


def apply(p: Plan, ca_cert: Path, ca_key: Path, cert: Path | None, key: Path | None, names: list[str], *,
          ca_common_name: str, valid_days: int, usage: str = "server") -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    now = _now()
    if p.new_ca:
        k = _new_key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_common_name)])
        ca = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(k.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now - DAY)
              .not_valid_after(now + CA_DAYS * DAY)
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                           crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(k.public_key()), critical=False)
              .sign(k, hashes.SHA256()))
        _write(ca_key, _key_pem(k), 0o600)
        _write(ca_cert, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    if p.new_key:
        _write(key, _key_pem(_new_key()), 0o600)
    if not p.issue:
        return
    issuer, issuer_key, server_key = _load_cert(ca_cert), _load_key(ca_key), _load_key(key)
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
              .issuer_name(issuer.subject).public_key(server_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now - DAY)
              .not_valid_after(now + valid_days * DAY)
              .add_extension(x509.SubjectAlternativeName(_general_names(names)), critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                           crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
              .add_extension(x509.ExtendedKeyUsage(sorted(_usage_oids(usage), key=lambda o: o.dotted_string)),
                             critical=False)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.public_key()), critical=False)
              .sign(issuer_key, hashes.SHA256()))
    _write(cert, server.public_bytes(serialization.Encoding.PEM), 0o644)


def main() -> None:
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(
        argument_spec={
            "ca_cert": {"type": "path", "required": True},
            "ca_key": {"type": "path", "required": True, "no_log": False},
            "cert": {"type": "path"},
            "key": {"type": "path", "no_log": False},
            "names": {"type": "list", "elements": "str"},
            "usage": {"type": "str", "choices": list(USAGES), "default": "server"},
            "ca_common_name": {"type": "str", "default": "shardstack cluster CA"},
            "valid_days": {"type": "int", "default": 397},
            "renew_days": {"type": "int", "default": 30},
        },
        required_together=[("cert", "key", "names")],
        supports_check_mode=True,
    )
    a = module.params
    if a["cert"] is None:
        try:
            p = plan_ca(Path(a["ca_cert"]), Path(a["ca_key"]))
            if p.reasons and not module.check_mode:
                apply(p, Path(a["ca_cert"]), Path(a["ca_key"]), None, None, [], ca_common_name=a["ca_common_name"],
                      valid_days=a["valid_days"])
        except (ValueError, OSError) as exc:
            module.fail_json(msg=str(exc))
        module.exit_json(changed=bool(p.reasons), reasons=p.reasons, not_after=None)
    paths = [Path(a[k]) for k in ("ca_cert", "ca_key", "cert", "key")]
    names = list(dict.fromkeys(canonical(n) for n in a["names"] if n))  # in order, once each
    if not names:
        module.fail_json(msg="names: at least one DNS name or IP address is needed")
    try:
        p = plan(*paths, names, renew_days=a["renew_days"], usage=a["usage"])
        if p.reasons and not module.check_mode:
            apply(p, *paths, names, ca_common_name=a["ca_common_name"], valid_days=a["valid_days"], usage=a["usage"])
    except (ValueError, OSError) as exc:
        module.fail_json(msg=str(exc))
    not_after = _load_cert(paths[2]).not_valid_after_utc.isoformat() if paths[2].exists() else None
    module.exit_json(changed=bool(p.reasons), reasons=p.reasons, not_after=not_after)


if __name__ == "__main__":
    main()
