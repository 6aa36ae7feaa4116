"""The SGLang backend's fleet key, in this environment (no SGLang needed): its settings
(the key, and no server reachable beyond its host without one) and the signing of its
ZMQ messages (integrations/sglang/signing.py). tests/test_sglang_pd.py runs both in
real SGLang servers, a prefill server with another key among them."""
import json
import logging

import pytest

from torch_kvops.integrations.sglang.settings import CONFIG_ENV, KvopsSglangSettings
from torch_kvops.integrations.sglang.signing import MessageSigner, SignedAborts

from conftest import FLEET_KEY as KEY  # key_file (the fixture) holds it

ROUTED = "198.18.0.1"  # an address beyond this host (is_loopback needs no interface)


def _settings(monkeypatch, **raw) -> KvopsSglangSettings:
    monkeypatch.setenv(CONFIG_ENV, json.dumps(raw))
    return KvopsSglangSettings.from_env()


def test_a_signed_message_opens_only_whole_and_under_the_same_key():
    signer = MessageSigner(KEY)
    frames = [b"KVOPS_AUX", b"42", b"\x01\x02"]
    signed = signer.sign(frames)
    assert len(signed) == 4 and signer.open(signed) == frames
    assert MessageSigner(bytes(KEY)).open(signed) == frames  # any server holding the key
    for forged in (frames,  # unsigned
                   [b"KVOPS_AUX", b"43", b"\x01\x02", signed[-1]],  # a frame changed
                   [b"KVOPS_AUX4", b"2", b"\x01\x02", signed[-1]],  # frames cut elsewhere
                   signed[:-1] + [signed[-1][:-1]],  # a short MAC
                   MessageSigner(b"k" * 32).sign(frames),  # another fleet's key
                   [signed[-1]]):
        with pytest.raises(ValueError, match="not signed with the fleet key"):
            signer.open(forged)
    unsigned = MessageSigner(None)  # no key: as before, nothing added or checked
    assert not unsigned.enabled and unsigned.sign(frames) == frames and unsigned.open(frames) == frames


def test_sglangs_abort_notice_leaves_signed_and_the_backends_messages_as_they_are():
    class Socket:  # what SGLang's receiver holds: a ZMQ socket (only what is sent matters)
        sent = []

        def send_multipart(self, frames):
            self.sent.append(list(frames))

    signer = MessageSigner(KEY)
    sock = SignedAborts(Socket(), signer, b"ABORT")
    abort = [b"ABORT", b"17", b"127.0.0.1", b"4000", b"3"]  # AbortNotification.to_zmq()
    ours = signer.sign([b"17", b"127.0.0.1", b"4000"])  # a destination, signed when built
    sock.send_multipart(abort)
    sock.send_multipart(ours)
    assert signer.open(Socket.sent[0]) == abort, "the abort notice opens under the fleet key"
    assert Socket.sent[1] == ours, "a message of the backend is not signed twice"
    with pytest.raises(ValueError):
        MessageSigner(b"k" * 32).open(Socket.sent[0])


def test_the_fleet_key_comes_from_the_settings_or_the_environment(monkeypatch, key_file, tmp_path):
    monkeypatch.delenv("KVOPS_FLEET_KEY_FILE", raising=False)
    assert _settings(monkeypatch).fleet_key() is None
    assert _settings(monkeypatch, fleet_key_file=key_file).fleet_key() == KEY
    monkeypatch.setenv("KVOPS_FLEET_KEY_FILE", key_file)
    assert _settings(monkeypatch).fleet_key() == KEY
    monkeypatch.delenv("KVOPS_FLEET_KEY_FILE")
    readable = tmp_path / "readable.key"
    readable.write_bytes(KEY)
    readable.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):  # at start-up, not at the first message
        _settings(monkeypatch, fleet_key_file=str(readable))
    with pytest.raises(ValueError, match="allow_insecure must be true or false"):
        _settings(monkeypatch, allow_insecure="yes")


def test_a_server_beyond_loopback_needs_a_fleet_key_or_allow_insecure(monkeypatch, key_file, caplog):
    monkeypatch.delenv("KVOPS_FLEET_KEY_FILE", raising=False)
    _settings(monkeypatch).check_exposure("127.0.0.1")  # loopback only: a single host
    with pytest.raises(ValueError, match="without a fleet key"):
        _settings(monkeypatch).check_exposure(ROUTED)
    _settings(monkeypatch, fleet_key_file=key_file).check_exposure(ROUTED)
    with caplog.at_level(logging.WARNING):
        _settings(monkeypatch, allow_insecure=True).check_exposure(ROUTED)
    assert "without a fleet key" in caplog.text and "allow_insecure: true" in caplog.text
