"""A CPU stand-in for megatron-core's tests/unit_tests/test_utilities.py (the part the
regression test uses): ``Utils.world_size``, ``Utils.rank``, ``Utils.initialize_model_parallel``
and ``Utils.destroy_model_parallel``, on gloo.

Rendezvous: a FileStore at ``$MEGATRON_TEST_FILESTORE`` when set (``run_gloo.py`` sets it, so no
port is opened), else torchrun's environment (``env://``).  On a machine with GPUs, run the test
in megatron-core's own tree with its own ``Utils`` instead.
"""

import os

import torch

from megatron.core import parallel_state as ps


class Utils:

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    inited = False

    @staticmethod
    def initialize_distributed():
        if torch.distributed.is_initialized():
            return
        store_path = os.environ.get("MEGATRON_TEST_FILESTORE")
        if store_path:
            torch.distributed.init_process_group(
                backend="gloo",
                store=torch.distributed.FileStore(store_path, Utils.world_size),
                rank=Utils.rank,
                world_size=Utils.world_size,
            )
        else:
            torch.distributed.init_process_group(backend="gloo")

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ):
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel():
        if not Utils.inited:
            return
        ps.destroy_model_parallel()
        torch.distributed.barrier()
        Utils.inited = False
