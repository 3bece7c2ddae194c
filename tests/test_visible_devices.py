"""The GPUs each worker sees (orchestrator/cluster/devices.py), as logic: what Ray assigned per
worker in, CUDA_VISIBLE_DEVICES per node and each worker's own index out. No GPU needed."""

from __future__ import annotations

import pytest

from gearshift.orchestrator.cluster.devices import DeviceShare, share_devices


def test_the_workers_of_a_node_see_the_same_gpus_and_each_takes_its_own():
    workers = [{"node_id": "a", "gpu_ids": ["2"]}, {"node_id": "a", "gpu_ids": ["0"]},
               {"node_id": "b", "gpu_ids": ["1"]}, {"node_id": "a", "gpu_ids": ["3"]},
               {"node_id": "b", "gpu_ids": ["0"]}]
    assert share_devices(workers) == [DeviceShare("0,2,3", 1), DeviceShare("0,2,3", 0), DeviceShare("0,1", 1),
                                      DeviceShare("0,2,3", 2), DeviceShare("0,1", 0)]


def test_indices_are_ordered_as_numbers_and_ints_are_taken_as_ray_gives_them():
    workers = [{"node_id": "a", "gpu_ids": [10]}, {"node_id": "a", "gpu_ids": [9]}, {"node_id": "a", "gpu_ids": [1]}]
    shares = share_devices(workers)
    assert shares[0].visible == "1,9,10" and [s.index for s in shares] == [2, 1, 0]
    for w, s in zip(workers, shares):  # each worker's index names its own GPU in its list
        assert s.visible.split(",")[s.index] == str(w["gpu_ids"][0])


def test_uuids_are_shared_as_text():
    workers = [{"node_id": "a", "gpu_ids": ["GPU-b"]}, {"node_id": "a", "gpu_ids": ["GPU-a"]}]
    assert share_devices(workers) == [DeviceShare("GPU-a,GPU-b", 1), DeviceShare("GPU-a,GPU-b", 0)]


def test_a_cpu_job_changes_nothing():
    assert share_devices([{"node_id": "a", "gpu_ids": []}, {"node_id": "a", "gpu_ids": []}]) == [None, None]


def test_a_worker_with_two_gpus_is_refused():
    with pytest.raises(ValueError, match="holds one GPU"):
        share_devices([{"node_id": "a", "gpu_ids": ["0", "1"]}])


def test_a_worker_keeps_its_one_gpu_once_cuda_has_started(monkeypatch):
    import os

    from gearshift.workers import worker

    monkeypatch.setattr(worker.torch.cuda, "is_initialized", lambda: True)
    from gearshift.workers.group.member import Member

    w = worker.TrainWorker.__new__(worker.TrainWorker)  # no process group, no config: only the group part
    w.member = Member.__new__(Member)
    w.member.device_index = None
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert w.use_devices("0,1", 1) is False
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before and w.member.device_index is None


def test_the_rendezvous_takes_the_shared_index():
    import inspect

    from gearshift.workers.group import rendezvous

    assert inspect.signature(rendezvous.join).parameters["device_index"].default == 0