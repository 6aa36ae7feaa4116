"""Fault injection for the SGLang tests, loaded by the SGLang servers of a test as an
SGLang general plugin (``sglang.srt.plugins``; :func:`serving_env`), never part of the
product. Modes, read from the file ``KVOPS_SABOTAGE_FILE`` names at every push (the
test's ``vllm_sabotage.Switch`` writes it), in the prefill server:

- ``misplace``: each push is handed the room's destination pages moved past its own
  (wrong page ids in the plan: the bytes land in pages of other requests, or free
  ones, and the room's pages keep what they held). A permutation of the room's own
  pages would be no control: attention over a prompt's keys ignores their order
  (positions are in the keys).
- ``misplace_heads``: each MHA part moves the next head range: where the decode rank
  holds more heads than the part, it writes them at the next range of its tokens (P
  at TP 2 to D at TP 1: the two prefill ranks' heads swap places); else it reads the
  next range of the prefill rank's (P at TP 1 to D at TP 2: each decode rank gets the
  other's head). The right pages, under the wrong heads.
- ``drop``: the transport reports every write done and moves no byte.
- ``drop_layer``: the writes of one KV buffer (the keys of layer 1) move no byte (the
  transport reports success); every other layer arrives. ``drop_layer0``: the same
  for the keys of layer 0 (a sliding-window layer of the SWA model).
- ``ignore_decode_prefix``: the forward's push takes no decode-side radix prefix
  (as before stop 51): it pushes the prompt from its first page into a destination
  that names pages for the rest only.
- ``short_window``: a sliding layer's window is taken as a quarter of its size, so
  the pages of its window's first three quarters (and more) are not pushed.
- ``window_to_caching_decode``: sliding layers' windows only, to a decode server with
  its radix cache too.
- ``no_renewal`` (in the decode server): the prefill servers' notices of the rooms they
  still owe are dropped, so no lease is renewed while a room waits in a prefill queue.
- ``short_lease`` (in the decode server): a room D expects gets a lease of
  ``SHORT_LEASE_S`` (a renewal or P's begin then extends it by the configured lease).
- ``slow_prefill``: each prefill forward starts ``SLOW_PREFILL_S`` late (before its push
  begins), so rooms wait in the prefill queue longer than a lease, whatever the
  machine's speed.
- ``unverified`` (in the decode server): the integrity check finds every layer's pages
  as the prefill server digested them, whatever they hold (the check switched off).
- ``unchecked`` (in the decode server): a room is expected without its pages, so a
  begin naming other pages is not refused (the check of the destination switched off).
- ``unsigned_aborts`` (in the decode server): SGLang's abort notice goes out unsigned.
"""
import dataclasses
import os
import time

from vllm_sabotage import modes, plugin_env

SLOW_PREFILL_S = 2.0
SHORT_LEASE_S = 5.0
STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_standin")


def serving_env(directory: str, *standins: str) -> dict:
    """Environment of an SGLang server: this module as a plugin, and the test-only
    stand-in for sgl_kernel's CPU kernels (tests/sglang_standin) on PYTHONPATH.
    ``standins``: more modules of tests/sglang_standin loaded as plugins
    (``cpu_mla_dispatch``, ``cpu_tp_groups``: their docstrings say why)."""
    env = plugin_env(directory, "sglang.srt.plugins", "sglang_sabotage:install")
    from torch_kvops.serving.fronts import write_entry_point  # the test's process only

    for module in standins:
        write_entry_point(directory, f"kvops-test-{module}", "sglang.srt.plugins", f"{module}:install")
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], STANDIN])
    return env


def install() -> None:
    from torch_kvops.integrations.sglang.signing import SignedAborts

    signed_send = SignedAborts.send_multipart

    def sabotaged_send(self, frames, *args, **kwargs):
        if "unsigned_aborts" in modes():
            return self._sock.send_multipart(frames, *args, **kwargs)
        return signed_send(self, frames, *args, **kwargs)

    SignedAborts.send_multipart = sabotaged_send
    from torch_kvops.connector import LayerwiseConnector
    from torch_kvops.connector.peer import PeerLink
    from torch_kvops.connector.verifier import Verifier
    from torch_kvops.integrations.sglang.layerwise import LayerwisePrefill
    from torch_kvops.integrations.sglang.manager import KvopsKVManager
    from torch_kvops.integrations.sglang.owed_notices import STILL_OWED
    from torch_kvops.integrations.sglang.push_queue import PushQueue
    from torch_kvops.transports.mooncake import MooncakeTransport
    from torch_kvops.integrations.sglang.windows import SlidingWindows

    ready_destinations = KvopsKVManager.ready_destinations
    run = PushQueue._run

    def moved(dest):
        return dataclasses.replace(dest, pages=dest.pages + len(dest.pages))

    def sabotaged_ready_destinations(self, room):  # the push in the forward
        found = ready_destinations(self, room)
        return [moved(d) for d in found] if "misplace" in modes() else found

    def sabotaged_run(self, batch):  # the push after the forward
        if "misplace" not in modes():
            return run(self, batch)
        infos = self.manager.transfer_infos
        kept = {room: dict(infos[room]) for room in {item[1] for item in batch if item[0] == "push"}
                if infos.get(room)}
        for room, sessions in kept.items():  # moved for this push only, never twice
            infos[room].update({s: moved(d) for s, d in sessions.items() if d is not None})
        try:
            return run(self, batch)
        finally:
            for room, sessions in kept.items():
                if room in infos:
                    infos[room].update(sessions)

    from torch_kvops.integrations.sglang.transfers import Destination

    request = Destination.request

    def sabotaged_request(self, room, src_pages, dst, last, windows=None):
        if "misplace_heads" in modes() and self.part is not None:
            part, n = self.part, len(self.part.heads)
            if part.dst_heads > n:
                part = dataclasses.replace(part, dst_offset=(part.dst_offset + n) % part.dst_heads)
            else:
                part = dataclasses.replace(part, src_offset=(part.src_offset + n) % part.src_heads)
            self = dataclasses.replace(self, part=part)
        if "window_to_caching_decode" in modes() and self.part is None:
            self = dataclasses.replace(self, windowed=True)
        return request(self, room, src_pages, dst, last, windows)

    Destination.request = sabotaged_request
    KvopsKVManager.ready_destinations = sabotaged_ready_destinations
    PushQueue._run = sabotaged_run
    write = MooncakeTransport.write

    def sabotaged_write(self, peer, src, dst, lengths, **kwargs):
        if "drop" in modes():
            return None
        return write(self, peer, src, dst, lengths, **kwargs)

    MooncakeTransport.write = sabotaged_write
    write_layer = PeerLink.write_layer

    def sabotaged_write_layer(self, layer, *args, **kwargs):
        if "drop_layer" in modes() and layer == 1:  # buffer 1: the keys of layer 1
            return 0, None
        if "drop_layer0" in modes() and layer == 0:  # the keys of layer 0 (sliding in the SWA model)
            return 0, None
        if "drop_window" in modes() and self.layout.layers[layer].id_base:  # a hybrid pool's windows
            return 0, None
        return write_layer(self, layer, *args, **kwargs)

    PeerLink.write_layer = sabotaged_write_layer
    on_decode_message = KvopsKVManager._on_decode_message

    def sabotaged_on_decode_message(self, msg):
        if "no_renewal" in modes() and msg[0] == STILL_OWED:
            return None
        return on_decode_message(self, msg)

    KvopsKVManager._on_decode_message = sabotaged_on_decode_message
    forward = LayerwisePrefill.forward

    def sabotaged_forward(self, original, runner, forward_batch, *args, **kwargs):
        if "slow_prefill" in modes() and forward_batch.forward_mode.is_extend():
            time.sleep(SLOW_PREFILL_S)
        return forward(self, original, runner, forward_batch, *args, **kwargs)

    LayerwisePrefill.forward = sabotaged_forward
    skip_decode_prefix = LayerwisePrefill.skip_decode_prefix

    def sabotaged_skip_decode_prefix(self, room, tokens):
        return skip_decode_prefix(self, room, 0 if "ignore_decode_prefix" in modes() else tokens)

    LayerwisePrefill.skip_decode_prefix = sabotaged_skip_decode_prefix
    expect = LayerwiseConnector.expect

    def sabotaged_expect(self, req_id, lease_s=None, blocks=None):
        how = modes()
        return expect(self, req_id, SHORT_LEASE_S if "short_lease" in how else lease_s,
                      None if "unchecked" in how else blocks)

    LayerwiseConnector.expect = sabotaged_expect
    verify = Verifier._verify

    def sabotaged_verify(self, *args, **kwargs):
        return None if "unverified" in modes() else verify(self, *args, **kwargs)

    Verifier._verify = sabotaged_verify
    cut = SlidingWindows.cut

    def sabotaged_cut(self, *args):
        if "short_window" in modes():
            self = dataclasses.replace(self, windows={b: w // 4 for b, w in self.windows.items()})
        return cut(self, *args)

    SlidingWindows.cut = sabotaged_cut
