"""Fault injection for the vLLM P/D tests, installed in the engine processes by the
test (``Engine(..., setup="vllm_sabotage:install")``), never part of the product.

The engines are sabotaged while the file named by ``KVOPS_SABOTAGE_FILE`` holds a
mode, or several separated by commas (the test writes it between requests). In the
prefill engine:

- ``drop``: the transport reports success and moves no byte;
- ``shift``: every write lands 4 KiB past its destination (transport level: into the
  neighbouring bytes, whether the write goes to a staging slot or to the cache);
- ``rotate``: the worker is handed destination blocks rotated by one within each
  chunk (a wrong block id in the plan; the consumer accepts it, the bytes land in
  the wrong blocks of the right request);
- ``drop_layer``: the writes of the second attention layer move no byte (the
  transport reports success), the other layers arrive;
- ``slow``: every push step begins 1.5 s late (a slow prefill, so that a test can
  act between two chunks);
- ``skip_after_preemption``: the scheduler pushes nothing more of a request it
  preempted (as if its pushes had ended);
- ``slow_steps``: every step that computes tokens takes 1.5 s longer (after its push
  plan is made), so a test can post a destination between two chunks;
- ``no_late_binding``: the scheduler runs with ``late_binding`` off (the feature
  switched off, for negative controls);
- ``no_release``: the worker reports in ``finished_sending`` only requests a push of
  which landed, so vLLM never frees the blocks of one whose transfer failed, was
  refused or given up (P's release path broken);
- ``freeze_mid_push``: once (a marker file next to the modes file records it), the
  engine stops itself with SIGSTOP in the middle of a push step, after its second
  attention layer was handed to the sender (a test resumes it with SIGCONT);
- ``no_fence``: P's side of the fence is off: the sender ignores its write lease and
  the decode side's revokes (docs/connector.md, "The fence");
- ``skip_last_block``: the worker leaves the last block out of each request's last
  chunk (a hole in a transfer that reports itself finished);
- ``no_link_release``: the worker never releases a link to a decode instance, failed
  or idle (integrations/vllm/links.py: P keeps every D it ever had);
- ``no_detach``: the sender waits for every peer's writes of a step before the step
  ends, however slow (``detach_slow_lanes_after_s`` off: a slow D holds up P's steps).

In a decode engine:

- ``trust_all``: a transfer that failed part-way is taken as whole (no block is
  reported as a load error, so vLLM keeps blocks that never received their KV);
- ``no_renewal``: the scheduler asks no prefill engine which transfers it still owes
  (the leases are never renewed, for negative controls);
- ``no_coverage_check``: a transfer part reported finished is taken as having filled
  every block it was expected to (the check for holes switched off);
- ``post_to_rank0``: every destination posted to a bootstrap endpoint names DP rank 0,
  whichever rank the router named (D posting to the wrong rank);
- ``slow_begin``: the consumer answers each producer's ``begin`` 3 s late (a slow D:
  its control thread stalls, so P's lane to it waits).

``vllm serve`` engines (torch_kvops.serving) load it as a vLLM general plugin in every
process (API server, engine core, workers): :func:`serving_env` gives a server the
environment that installs it (``ServerSpec(env=...)``) for its role.
"""
import os
import signal
import time

_installed = False


class Switch:
    """Test side: the file the engines read their modes from, created empty (no
    sabotage) in ``directory`` and named in ``KVOPS_SABOTAGE_FILE`` for the engine
    processes started next (they inherit it)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "sabotage")
        self.set("")
        os.environ["KVOPS_SABOTAGE_FILE"] = self.path

    def set(self, *how: str) -> None:
        with open(self.path, "w") as f:
            f.write(",".join(m for m in how if m))

    def close(self) -> None:
        os.environ.pop("KVOPS_SABOTAGE_FILE", None)


def modes() -> set:
    path = os.environ.get("KVOPS_SABOTAGE_FILE")
    if not path:
        raise RuntimeError("KVOPS_SABOTAGE_FILE is not set in the engine process")
    with open(path) as f:
        return {m.strip() for m in f.read().split(",") if m.strip()}


def serving_env(directory: str, role: str) -> dict:
    """Environment for a ``vllm serve`` engine of ``role`` ("prefill" or "decode") that
    installs this module through vLLM's ``vllm.general_plugins`` entry point group: a
    distribution's metadata in ``directory``, which goes on PYTHONPATH with this file's
    folder. The test's :class:`Switch` names the modes file (KVOPS_SABOTAGE_FILE)."""
    return dict(plugin_env(directory, "vllm.general_plugins", "vllm_sabotage:install_serving"),
                KVOPS_SABOTAGE_ROLE=role)


def plugin_env(directory: str, group: str, target: str) -> dict:
    """Environment that makes an engine load ``target`` (``module:function`` in this
    folder) as a plugin of entry point ``group``: a distribution's metadata written
    into ``directory``, which goes on PYTHONPATH with this file's folder."""
    from torch_kvops.serving.fronts import write_entry_point  # the test's process only

    write_entry_point(directory, "kvops-test-sabotage", group, target)
    return {"PYTHONPATH": os.pathsep.join([directory, os.path.dirname(os.path.abspath(__file__))])}


def install_serving() -> None:
    """vLLM general plugin: install for this server's role, once per process."""
    install(os.environ["KVOPS_SABOTAGE_ROLE"])


def install(process_name: str) -> None:
    global _installed
    if _installed:  # a forked process already has the patches of its parent
        return
    _installed = True
    if process_name.startswith("decode"):
        install_decode()
    if process_name != "prefill":
        return
    from torch_kvops.integrations.vllm import scheduler as vllm_scheduler
    from torch_kvops.integrations.vllm.worker_producer import ProducerWorker
    from torch_kvops.transports.mooncake import MooncakeTransport

    from torch_kvops.connector.peer import PeerLink

    from torch_kvops.integrations.vllm.links import DecodeLinks

    release_idle = DecodeLinks.release_idle

    def sabotaged_release_idle(self):
        if "no_link_release" not in modes():
            release_idle(self)

    DecodeLinks.release_idle = sabotaged_release_idle
    write = MooncakeTransport.write
    write_layer = PeerLink.write_layer
    check_write_lease = PeerLink.check_write_lease
    acknowledge_revokes = PeerLink.acknowledge_revokes
    save_kv_layer = ProducerWorker.save_kv_layer

    def sabotaged_check_write_lease(self, what):
        if "no_fence" not in modes():
            check_write_lease(self, what)

    def sabotaged_acknowledge_revokes(self):
        if "no_fence" in modes():
            return set()
        return acknowledge_revokes(self)

    def sabotaged_save_kv_layer(self, layer_name):
        save_kv_layer(self, layer_name)
        marker = os.environ["KVOPS_SABOTAGE_FILE"] + ".frozen"
        pushing = self._step_mode == "layerwise"
        if pushing and "freeze_mid_push" in modes() and ".layers.1." in layer_name \
                and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(0.3)  # the sender writes the layers handed over so far
            os.kill(os.getpid(), signal.SIGSTOP)

    def sabotaged_write_layer(self, layer, *args, **kwargs):
        if "drop_layer" in modes() and layer == 1:
            return 0, None
        return write_layer(self, layer, *args, **kwargs)

    def sabotaged_write(self, peer, src, dst, lengths, **kwargs):
        how = modes()
        if "drop" in how:
            return None
        if "shift" in how:
            dst = [int(d) + 4096 for d in dst]
        return write(self, peer, src, dst, lengths, **kwargs)

    begin_step = ProducerWorker.begin_step
    get_finished = ProducerWorker.get_finished

    def sabotaged_get_finished(self, finished_req_ids):
        """``no_release``: report in finished_sending only the requests a push of
        which landed; every other way out (failed or refused pushes, an unreachable
        decode rank, released holds, aborts) keeps its blocks."""
        if "no_release" not in modes():
            return get_finished(self, finished_req_ids)
        landed = self.__dict__.setdefault("_sabotage_landed", set())
        parts = dict(self._tid_to_req)
        collect = self.conn.get_finished

        def collecting():
            done, failed = collect()
            landed.update(parts[t] for t in done if t in parts)
            return done, failed
        self.conn.get_finished = collecting
        try:
            sending, recving, failed = get_finished(self, finished_req_ids)
        finally:
            del self.conn.get_finished
        released = sending & landed
        landed -= released
        return released, recving, failed

    def sabotaged_begin_step(self, meta):
        how = modes()
        if "rotate" in how:
            for push in meta.push:
                push.dst_blocks = push.dst_blocks[1:] + push.dst_blocks[:1]
        if "skip_last_block" in how:
            for push in meta.push:
                if push.last_chunk and len(push.dst_blocks) > 1:
                    push.src_blocks, push.dst_blocks = push.src_blocks[:-1], push.dst_blocks[:-1]
        if "slow" in how and meta.push:
            time.sleep(1.5)
        return begin_step(self, meta)

    build_connector_meta = vllm_scheduler.ProducerScheduler.build_connector_meta

    def sabotaged_build_connector_meta(self, out, meta):
        how = modes()
        if "skip_after_preemption" in how:
            for req_id in out.preempted_req_ids or ():
                if req_id in self._pushes:
                    self._pushes[req_id].done = True
        result = build_connector_meta(self, out, meta)
        if "slow_steps" in how and out.total_num_scheduled_tokens > 0:
            time.sleep(1.5)
        return result

    matched = vllm_scheduler.ProducerScheduler.get_num_new_matched_tokens

    def sabotaged_matched(self, request, num_computed_tokens):
        if not hasattr(self, "_configured_late_binding"):
            self._configured_late_binding = self.settings.late_binding
        self.settings.late_binding = self._configured_late_binding and "no_late_binding" not in modes()
        return matched(self, request, num_computed_tokens)

    from torch_kvops.connector.sender import StepSender

    join_lanes = StepSender._join_lanes

    def sabotaged_join_lanes(self, lanes, detach_after_s):
        return join_lanes(self, lanes, None if "no_detach" in modes() else detach_after_s)

    StepSender._join_lanes = sabotaged_join_lanes
    MooncakeTransport.write = sabotaged_write
    PeerLink.write_layer = sabotaged_write_layer
    PeerLink.check_write_lease = sabotaged_check_write_lease
    PeerLink.acknowledge_revokes = sabotaged_acknowledge_revokes
    ProducerWorker.save_kv_layer = sabotaged_save_kv_layer
    ProducerWorker.begin_step = sabotaged_begin_step
    ProducerWorker.get_finished = sabotaged_get_finished
    vllm_scheduler.ProducerScheduler.build_connector_meta = sabotaged_build_connector_meta
    vllm_scheduler.ProducerScheduler.get_num_new_matched_tokens = sabotaged_matched


def install_decode() -> None:
    from torch_kvops.integrations.vllm.worker_consumer import ConsumerWorker

    valid_blocks = ConsumerWorker._valid_blocks

    def sabotaged_valid_blocks(self, landed):
        if "trust_all" in modes():
            return set(range(self.num_blocks))
        return valid_blocks(self, landed)

    part_ended = ConsumerWorker._part_ended

    def sabotaged_part_ended(self, part, ok, landed):
        if ok and "no_coverage_check" in modes():
            landed = [self._part_units[part]]
        return part_ended(self, part, ok, landed)

    from torch_kvops.connector.consumer_admission import BeginAdmission

    admit_begin = BeginAdmission._admit_begin

    def sabotaged_admit_begin(self, message, session):
        if "slow_begin" in modes():
            time.sleep(3.0)
        return admit_begin(self, message, session)

    BeginAdmission._admit_begin = sabotaged_admit_begin
    ConsumerWorker._valid_blocks = sabotaged_valid_blocks
    ConsumerWorker._part_ended = sabotaged_part_ended

    from torch_kvops.integrations.vllm.scheduler_consumer import ConsumerScheduler

    renew_owed = ConsumerScheduler._renew_owed

    def sabotaged_renew_owed(self, meta):
        if "no_renewal" not in modes():
            renew_owed(self, meta)

    ConsumerScheduler._renew_owed = sabotaged_renew_owed

    from torch_kvops.integrations.vllm.params import DecodeParams

    post_to = DecodeParams.post_to

    def sabotaged_post_to(self):
        address = post_to.fget(self)
        if "post_to_rank0" in modes() and "#" in address:
            base, _, engine = address.partition("#")
            return f"{base}#{engine.rpartition('_dp')[0]}_dp0"
        return address

    DecodeParams.post_to = property(sabotaged_post_to)
