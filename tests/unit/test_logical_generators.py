"""``torch.cuda.default_generators`` answers a logical device index (Megatron-core
indexes it by ``current_device()``), on a stand-in module: torch's C++ side
assigns the tuple when CUDA initialises, after Prism patched the module."""

import types

from prism.rank import devices


def test_any_logical_index_names_the_one_generator():
    mod = types.ModuleType("fake_cuda")
    mod.default_generators = ()
    devices.logical_generators(mod)
    gen = object()
    mod.default_generators = (gen,)  # what CUDA's initialisation does
    assert mod.default_generators[0] is gen and mod.default_generators[5] is gen
    assert len(mod.default_generators) == 1 and list(mod.default_generators) == [gen]
    assert mod.default_generators[-1] is gen


def test_a_tuple_written_into_the_dict_directly_is_still_mapped():
    mod = types.ModuleType("fake_cuda")
    devices.logical_generators(mod)
    gen = object()
    mod.__dict__["default_generators"] = (gen,)
    assert mod.default_generators[3] is gen
