"""RayPPCommunicator against a real gloo PP group inside real Ray actors."""

from __future__ import annotations

import inspect

import pytest
import ray
import torch

from raypp.distributed import ray_compat
from raypp.distributed.ray_communicator import RayPPCommunicator


@ray.remote(num_cpus=0)
class _Rank:
    """A minimal PP-only worker: joins the world and builds the groups."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def address(self) -> str:
        from raypp.distributed.ports import free_port

        return f"tcp://127.0.0.1:{free_port()}"

    def init(self, init_method: str) -> None:
        from raypp.distributed import parallel_state

        layout = parallel_state.RankLayout(tp_size=1, pp_size=self.world)
        parallel_state.init_distributed(layout, self.rank, init_method, torch.device("cpu"), 20)

    def setup_comm(self, comm: RayPPCommunicator) -> dict:
        comm.initialize(rank=99)  # Ray's rank is ignored in favour of the PP group's
        self.comm = comm
        return {"self_rank": comm.get_self_rank(), "map": comm._actor_id_to_rank}

    def rank_of(self, actor) -> int:
        return self.comm.get_rank(actor)

    def send(self, peer: int, value: float) -> None:
        self.comm.send(torch.full((3, 4), value), peer)

    def recv(self, peer: int) -> list:
        return self.comm.recv((3, 4), torch.float32, peer).tolist()

    def send_many(self, peer: int, shapes: list, dtype: str) -> None:
        for i, shape in enumerate(shapes):
            t = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64) + i
            self.comm.send(t.reshape(shape).to(getattr(torch, dtype)), peer)

    def recv_many(self, peer: int, shapes: list, dtype: str) -> list:
        out = []
        for i, shape in enumerate(shapes):
            t = self.comm.recv(tuple(shape), getattr(torch, dtype), peer)
            want = (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64) + i)
            out.append(torch.equal(t, want.reshape(shape).to(getattr(torch, dtype))))
        return out

    def send_objects(self, peer: int, objs: list) -> None:
        from raypp.distributed import parallel_state

        for obj in objs:
            parallel_state.get_pp_group().send_object(obj, peer)

    def recv_objects(self, peer: int, n: int) -> list:
        from raypp.distributed import parallel_state

        return [parallel_state.get_pp_group().recv_object(peer) for _ in range(n)]

    def transport(self) -> bool:
        from raypp.distributed import parallel_state

        pipes = parallel_state.get_pp_group().device_communicator.pipes
        return pipes is not None and pipes.reaches(1 - self.rank)

    def destroy(self) -> None:
        self.comm.destroy()
        self.comm.destroy()  # idempotent

    def group_all_reduce(self, value: float) -> float:
        from raypp.distributed import parallel_state

        t = torch.tensor([value])
        return parallel_state.get_pp_group().all_reduce(t).item()

    def shutdown(self) -> None:
        from raypp.distributed import parallel_state

        parallel_state.destroy_distributed()


@pytest.fixture(scope="module")
def pair(ray_cluster):
    actors = [_Rank.remote(r, 2) for r in range(2)]
    address = ray.get(actors[0].address.remote())
    ray.get([a.init.remote(address) for a in actors])
    comm = RayPPCommunicator(actors)
    infos = ray.get([a.setup_comm.remote(comm) for a in actors])
    yield actors, comm, infos
    ray.get([a.shutdown.remote() for a in actors])
    for a in actors:
        ray.kill(a)


def test_ranks_come_from_the_pp_group(pair):
    actors, comm, infos = pair
    assert [i["self_rank"] for i in infos] == [0, 1]
    ids = [a._ray_actor_id.hex() for a in actors]
    # the all-gathered map is the same on every rank and matches handle order
    assert infos[0]["map"] == infos[1]["map"] == {ids[0]: 0, ids[1]: 1}
    assert ray.get(actors[0].rank_of.remote(actors[1])) == 1
    # on the driver (before initialize) ranks follow handle order
    assert comm.get_rank(actors[1]) == 1 and comm.get_world_size() == 2
    assert comm.get_transport_name() == "accelerator"


def test_foreign_actor_has_no_rank(pair, ray_cluster):
    actors, comm, _ = pair
    stranger = _Rank.remote(5, 9)
    try:
        with pytest.raises(ValueError, match="not in this PP group"):
            comm.get_rank(stranger)
        with pytest.raises(ray.exceptions.RayTaskError, match="not in this PP group"):
            ray.get(actors[0].rank_of.remote(stranger))
    finally:
        ray.kill(stranger)


def test_send_recv_carries_tensors(pair):
    actors, _, _ = pair
    recv = actors[1].recv.remote(0)
    ray.get(actors[0].send.remote(1, 2.5))
    assert ray.get(recv) == [[2.5] * 4] * 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_host_pipes_carry_any_size_in_order(pair, dtype):
    """Same-host ranks use shared-memory slots + a Unix socket: sizes from empty to
    several MiB (the ring grows), more messages than slots in flight, all exact."""
    actors, _, _ = pair
    assert ray.get(actors[0].transport.remote()) and ray.get(actors[1].transport.remote())
    before = _segment_names()  # /dev/shm is shared with every other process on the host
    shapes = [[3, 4], [0, 8], [], [1, 4096], [512, 4096], [2, 2], [64, 4096], [5]]
    receiving = actors[1].recv_many.remote(0, shapes, dtype)
    ray.get(actors[0].send_many.remote(1, shapes, dtype))
    assert ray.get(receiving) == [True] * len(shapes)
    assert not _segment_names() - before, "segment names left"


def _segment_names() -> set[str]:
    import os

    return {f for f in os.listdir("/dev/shm") if f.startswith("raypp-")}


def test_objects_ride_the_same_host_pipes_in_order(pair):
    actors, _, _ = pair
    objs = [{"step": 1}, list(range(100_000)), "x" * 3_000_000, None, ("tail", 2.5)]
    receiving = actors[1].recv_objects.remote(0, len(objs))
    ray.get(actors[0].send_objects.remote(1, objs))
    assert ray.get(receiving) == objs


def test_ids_need_no_cupy():
    ids = {RayPPCommunicator.generate_communicator_id() for _ in range(3)}
    assert len(ids) == 3


def test_destroy_closes_wrapper_but_keeps_group(pair):
    actors, _, _ = pair
    ray.get([a.destroy.remote() for a in actors])
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(actors[0].send.remote(1, 1.0))
    assert "RayChannelError" in str(err.value) or "destroyed" in str(err.value)
    with pytest.raises(ray.exceptions.RayTaskError, match="destroyed"):
        ray.get(actors[1].recv.remote(0))
    # the engine's group itself still works
    assert ray.get([a.group_all_reduce.remote(1.5) for a in actors]) == [3.0, 3.0]


def test_ray_internals_the_shim_relies_on_are_unchanged():
    """Fails loudly when Ray changes the code raypp's shim replaces (re-check it then)."""
    from ray.experimental.channel import torch_tensor_accelerator_channel as m

    assert ray_compat.ray_version_is_tested(), f"shim not verified on Ray {ray.__version__}"
    writer = inspect.getsource(m._TorchTensorAcceleratorChannel.ensure_registered_as_writer)
    reader = inspect.getsource(m._TorchTensorAcceleratorChannel.ensure_registered_as_reader)
    assert 'torch_device.type != "cpu"' in writer and 'torch_device.type != "cpu"' in reader
    read = inspect.getsource(m.TorchTensorAcceleratorChannel.read)
    # stock read fetches tensors, then the CPU part, with nothing kept across a timeout
    assert "tensors = self._gpu_data_channel.read(timeout)" in read
    assert "_recv_cpu_and_gpu_data(tensors, timeout)" in read
    # the stage loop's reader still reads with blocking per-iteration timeouts
    from ray.experimental.channel import common

    reader = inspect.getsource(common.SynchronousReader._read_list)
    assert "c.read(min(remaining_timeout, iteration_timeout))" in reader
    assert "_consume_leftover_channels_if_needed(timeout)" in reader


def test_closing_sender_removes_a_segment_no_receiver_mapped():
    """A message sent but never received leaves no /dev/shm name once the sender closes."""
    import torch

    from raypp.distributed.local_pipes import LocalPipes

    sender, receiver = LocalPipes(0, timeout_s=5.0), LocalPipes(1, timeout_s=5.0)
    try:
        sender.connect_peers({0: sender.address, 1: receiver.address})
        before = _segment_names()
        sender.send(torch.ones(4), dst=1)
        assert len(_segment_names() - before) == 1  # waiting for a receiver to map it
        sender.close()
        assert not _segment_names() - before
    finally:
        sender.close()
        receiver.close()


def test_rendezvous_port_is_free_and_outside_the_ephemeral_range(monkeypatch, tmp_path):
    """A port another process may bind later: free now, and below the range the kernel
    gives out for outgoing connections; ``bind(0)`` when that range leaves no room."""
    import socket

    from raypp.distributed import ports

    low = ports._ephemeral_start()
    for _ in range(20):
        port = ports.free_port()
        assert ports._LOWEST <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    squeezed = tmp_path / "range"
    squeezed.write_text("1024\t65000\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", squeezed)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.free_port()))
