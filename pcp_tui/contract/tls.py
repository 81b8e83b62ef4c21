"""Optional TLS for the shepherd-worker link: contexts, certificate pinning, wrapping.

The join token already keeps strangers out without crossing the wire; TLS adds
what the token cannot: nobody on the path can read the graphs, parameters and
pseudo-gradients, alter them, or pose as the shepherd. A worker trusts the
shepherd either through a CA file (`--tls-ca`) or by pinning the SHA-256
fingerprint of its certificate (`--tls-fingerprint`, printed in the join
command), which suits a self-signed certificate.
"""

from __future__ import annotations

import hashlib
import re
import ssl
from dataclasses import dataclass

import trio

TLS_HANDSHAKE_SECONDS = 30.0
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


class TLSRefused(Exception):
    """This worker must not talk to that shepherd: untrusted certificate, wrong pin, no TLS there."""


def fingerprint(der: bytes) -> str:
    """SHA-256 of a DER certificate, as 64 lowercase hex digits."""
    return hashlib.sha256(der).hexdigest()


def shown_fingerprint(transport: trio.abc.Stream) -> str:
    """The fingerprint of the certificate the shepherd showed on `transport`; "" for plain
    TCP. A worker's key signs it (`keys.sign_hello`)."""
    if isinstance(transport, trio.SSLStream):
        return fingerprint(transport.getpeercert(binary_form=True) or b"")
    return ""


def normalize_fingerprint(text: str) -> str:
    """Accept `ab12...`, `AB:12:...` or openssl's `SHA256 Fingerprint=AB:12:...`; ValueError otherwise."""
    digits = re.sub(r"[\s:]", "", text.split("=")[-1].removeprefix("sha256")).lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digits):
        raise ValueError(f"--tls-fingerprint wants the 64 hex digits of a SHA-256, got {text!r}")
    return digits


def _first_certificate_der(cert_path: str) -> bytes:
    with open(cert_path, "rb") as file:
        found = _PEM_CERT.search(file.read())
    if found is None:
        raise ValueError(f"{cert_path} holds no PEM certificate")
    return ssl.PEM_cert_to_DER_cert(found.group(0).decode("ascii"))


@dataclass(frozen=True)
class ServerTLS:
    """The shepherd's certificate and key, ready to wrap accepted connections."""

    context: ssl.SSLContext
    fingerprint: str

    @classmethod
    def from_files(cls, cert_path: str, key_path: str) -> ServerTLS:
        """ValueError with a one-line reason when the files cannot be used."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(cert_path, key_path)
            der = _first_certificate_der(cert_path)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"cannot use --tls-cert {cert_path} / --tls-key {key_path}: {exc.strerror or exc}"
            ) from None
        return cls(context, fingerprint(der))

    def worker_flags(self) -> list[str]:
        """What a worker adds to its command line to trust this shepherd."""
        return ["--tls-fingerprint", self.fingerprint]

    async def accept(self, raw: trio.abc.Stream) -> trio.SSLStream:
        """Run the server side of the TLS handshake; trio.BrokenResourceError if it fails."""
        stream = trio.SSLStream(raw, self.context, server_side=True)
        await stream.do_handshake()
        return stream


@dataclass(frozen=True)
class ClientTLS:
    """How a worker checks the shepherd: a CA file, a pinned fingerprint, or both."""

    context: ssl.SSLContext
    pinned: str | None = None

    @classmethod
    def from_options(
        cls, ca_path: str | None = None, pinned: str | None = None
    ) -> ClientTLS | None:
        """None when neither is given (plain TCP). ValueError for a bad file or fingerprint."""
        if not ca_path and not pinned:
            return None
        pin = normalize_fingerprint(pinned) if pinned else None
        if ca_path:
            try:
                context = ssl.create_default_context(cafile=ca_path)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot use --tls-ca {ca_path}: {exc.strerror or exc}") from None
        else:  # the pin is the trust anchor: a self-signed certificate has no CA to check
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return cls(context, pin)

    async def connect(self, raw: trio.abc.Stream, host: str) -> trio.SSLStream:
        """Wrap a fresh TCP stream and verify the shepherd.

        TLSRefused when the shepherd cannot be trusted (a final answer: do not
        retry); ConnectionError when the network failed (worth retrying).
        """
        stream = trio.SSLStream(raw, self.context, server_hostname=host)
        try:
            with trio.fail_after(TLS_HANDSHAKE_SECONDS):
                await stream.do_handshake()
            if self.pinned is not None:
                seen = fingerprint(stream.getpeercert(binary_form=True) or b"")
                if seen != self.pinned:
                    raise TLSRefused(
                        f"the shepherd's certificate has SHA-256 {seen}, not the pinned {self.pinned}: "
                        "someone may be posing as the shepherd, or it has a new certificate "
                        "(use the --tls-fingerprint of its current join command)"
                    )
        except trio.BrokenResourceError as exc:
            await trio.aclose_forcefully(raw)
            raise _classify(exc.__cause__) from None
        except trio.TooSlowError:
            await trio.aclose_forcefully(raw)
            raise ConnectionError("the TLS handshake with the shepherd timed out") from None
        except TLSRefused:
            await trio.aclose_forcefully(raw)
            raise
        return stream


def _classify(cause: BaseException | None) -> Exception:
    if isinstance(cause, ssl.SSLCertVerificationError):
        return TLSRefused(
            f"the shepherd's certificate is not trusted ({cause.verify_message}): pass the CA that "
            "signed it with --tls-ca, or pin it with the --tls-fingerprint of its join command"
        )
    if isinstance(cause, ssl.SSLError) and not isinstance(
        cause, ssl.SSLEOFError | ssl.SSLZeroReturnError
    ):
        return TLSRefused(
            f"TLS handshake with the shepherd failed ({cause.reason or cause}): "
            "is the shepherd started with --tls-cert/--tls-key?"
        )
    return ConnectionError(f"connection lost during the TLS handshake ({cause or 'closed'})")
