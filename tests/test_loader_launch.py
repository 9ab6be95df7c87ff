"""KernelLibrary.launch (one packed argument block per call) against the ctypes path (one ctypes
object per argument, the oracle), for every kernel spec, without a GPU or a built library.

The launch functions are stand-ins that read, during the call, the `void *args[]` they are given
and the bytes each pointer points at (sizes from the ctypes structs of the oracle)."""

import ctypes
import random

import pytest
import torch

from mok_nn.kernels import loader, registry

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8,
          "u16": torch.uint16}


class FakeTensor:
    """What launch reads of a CUDA tensor: dtype, shape, stride(), dim(), data_ptr(), is_cuda."""

    def __init__(self, dtype, shape, stride, ptr, is_cuda=True):
        self.dtype, self.shape, self._stride = dtype, torch.Size(shape), tuple(stride)
        self._ptr, self.is_cuda = ptr, is_cuda

    def stride(self):
        return self._stride

    def dim(self):
        return len(self.shape)

    def data_ptr(self):
        return self._ptr

    def but(self, **kw):
        d = dict(dtype=self.dtype, shape=self.shape, stride=self._stride, ptr=self._ptr, is_cuda=self.is_cuda)
        d.update(kw)
        return FakeTensor(**d)


def arg_sizes(spec):
    """Bytes behind each pointer of the ctypes path: the struct, 4 per scalar, 8 for the stream."""
    sizes = []
    for a in spec.args:
        if isinstance(a, registry.ScalarArg):
            sizes.append(4)
        else:
            sizes.append(ctypes.sizeof(loader._struct_type(len(a.dyn_shape_modes()), len(a.dyn_stride_modes()))))
    return sizes + [8]


class Recorder:
    """Stand-in launch function of one kernel: records the argument bytes of each call."""

    def __init__(self, spec, rc=0):
        self.sizes, self.rc, self.calls = arg_sizes(spec), rc, []

    def __call__(self, p):
        addr = p if isinstance(p, int) else ctypes.addressof(p)
        ptrs = (ctypes.c_void_p * len(self.sizes)).from_address(addr)
        self.calls.append([ctypes.string_at(q, n) for q, n in zip(ptrs, self.sizes)])
        self.passed, self.ptrs = p, list(ptrs)
        return self.rc


def make_lib(rc=0):
    fns = {s.name: Recorder(s, rc) for s in registry.SPECS}
    return loader.KernelLibrary.from_functions("fake.so", fns, lambda rc: f"error {rc}")


def rand_tensor(a, rng, unit_modes=False):
    """A fake tensor fitting TensorArg a: random extents (multiples of the divisibility; extent 1 where
    allowed and unit_modes), strides (multiples of the stride divisibility; any value where the extent
    is 1 and the stride fixed, as the checks allow), data pointer (a multiple of the alignment)."""
    div = a.divisibility or (1,) * len(a.shape)
    shape, stride = [], []
    for i, (s, st) in enumerate(zip(a.shape, a.stride)):
        if s == registry.DYN:
            s = div[i] * (1 if unit_modes and div[i] == 1 else rng.randint(1, 40))
        shape.append(s)
        if st == registry.DYN:
            st = a.stride_divisibility * rng.randint(0 if s == 1 else 1, 5000)
        elif s == 1 and rng.random() < 0.5:
            st = rng.randint(-5, 10**6)  # unchecked where the extent is 1
        stride.append(st)
    return FakeTensor(DTYPES[a.dtype], shape, stride, a.align * rng.randint(1, 2**44))


def rand_args(spec, rng, unit_modes=False):
    out = []
    for a in spec.args:
        if isinstance(a, registry.ScalarArg):
            out.append(rng.randint(-(2**31), 2**31 - 1) if a.dtype == "i32" else rng.uniform(-1e4, 1e4))
        else:
            out.append(rand_tensor(a, rng, unit_modes))
    return out


def launched(lib, how, name, args, stream):
    getattr(lib, how)(name, *args, stream=stream)
    return lib._fns[name].calls[-1]


def same_bytes(name, args, stream):
    """Both paths launch (fresh libraries) and pass the same bytes."""
    packed = launched(make_lib(), "launch", name, args, stream)
    return packed == launched(make_lib(), "launch_ctypes", name, args, stream)


SPEC_NAMES = [s.name for s in registry.SPECS]


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_packed_bytes_equal_ctypes_bytes(name):
    spec = registry.SPECS_BY_NAME[name]
    rng = random.Random(name)
    lib, oracle = make_lib(), make_lib()
    for it in range(12):  # repeated calls: new pointers / extents / scalars after a cached signature
        args = rand_args(spec, rng, unit_modes=it % 3 == 2)
        stream = rng.randrange(2**64)
        got = launched(lib, "launch", name, args, stream)
        assert isinstance(lib._fns[name].passed, int), "the packed path passes an address"
        assert all(q % 8 == 0 for q in lib._fns[name].ptrs), "argument blocks 8-byte aligned"
        assert got == launched(oracle, "launch_ctypes", name, args, stream)
        # the same signature again, other data pointers: the validation cache must not keep old values
        args2 = [t.but(ptr=t.data_ptr() + 64 * a.align) if isinstance(t, FakeTensor) else t
                 for a, t in zip(spec.args, args)]
        got = launched(lib, "launch", name, args2, stream ^ 1)
        assert got == launched(oracle, "launch_ctypes", name, args2, stream ^ 1)
    assert len(lib._fns[name].calls) == 24


def test_packed_bytes_decode():
    """Independent of the oracle: the fields of mok_combine's block where the C layout puts them."""
    import struct

    spec = registry.SPECS_BY_NAME["mok_combine"]
    rows = FakeTensor(torch.bfloat16, (5, 24), (40, 1), 0x1000)
    pos = FakeTensor(torch.int64, (7, 3), (3, 1), 0x2008)
    w = FakeTensor(torch.float32, (7, 3), (5, 1), 0x3004)
    ids = FakeTensor(torch.int64, (7, 3), (4, 1), 0x5000)
    out = FakeTensor(torch.bfloat16, (7, 24), (32, 1), 0x4000)
    lib = make_lib()
    got = launched(lib, "launch", spec.name, [rows, pos, w, ids, out, 33], 0xABCDEF)
    # {void *data; int32_t shapes[2]; int64_t strides[1];}: 8 + 8 + 8 bytes, no padding
    assert got[0] == struct.pack("<Qiiq", 0x1000, 5, 24, 40)
    assert got[1] == struct.pack("<Qiiq", 0x2008, 7, 3, 3)
    assert got[2] == struct.pack("<Qiiq", 0x3004, 7, 3, 5)
    assert got[3] == struct.pack("<Qiiq", 0x5000, 7, 3, 4)
    assert got[4] == struct.pack("<Qiiq", 0x4000, 7, 24, 32)
    assert got[5] == struct.pack("<i", 33)  # experts_per_leaf
    assert got[6] == struct.pack("<Q", 0xABCDEF)
    # gemm a (M, K, 1), strides (DYN, 1, 0): {data; int32 shapes[2]; int64 strides[1]}; group_m int32
    spec = registry.SPECS_BY_NAME["mok_gemm_bk"]
    rng = random.Random(1)
    args = rand_args(spec, rng)
    args[6] = -7
    got = launched(lib, "launch", spec.name, args, 5)
    a = args[0]
    assert got[0] == struct.pack("<Qiiq", a.data_ptr(), a.shape[0], a.shape[1], a.stride()[0])
    b = args[1]  # (N, K, E), strides (DYN, 1, DYN): 3 shapes, 4 bytes padding, 2 strides
    assert got[1] == struct.pack("<Qiii4xqq", b.data_ptr(), *b.shape, b.stride()[0], b.stride()[2])
    te = args[3]  # (DYN,) stride (1,): {data; int32 shapes[1];} padded to 16
    assert got[3] == struct.pack("<Qi4x", te.data_ptr(), te.shape[0])
    assert got[6] == struct.pack("<i", -7)


def mutations(a, t):
    """(label, bad tensor, words of the expected error) per check of loader.check_tensor that applies
    to TensorArg a; the label 'ok' marks changes the checks allow (stride of an extent-1 mode)."""
    other = torch.float32 if t.dtype != torch.float32 else torch.bfloat16
    yield "dtype", t.but(dtype=other), (TypeError, "dtype")
    yield "dims", t.but(shape=tuple(t.shape) + (1,), stride=t.stride() + (1,)), (ValueError, "dims")
    yield "cpu", t.but(is_cuda=False), (ValueError, "must be a CUDA tensor")
    yield "align", t.but(ptr=t.data_ptr() + a.align // 2), (ValueError, "aligned")
    div = a.divisibility or (1,) * len(a.shape)
    for i, (s, st) in enumerate(zip(a.shape, a.stride)):
        shape, stride = list(t.shape), list(t.stride())
        if s != registry.DYN:
            shape[i] = s + 1
            yield f"extent{i}", t.but(shape=shape), (ValueError, "has extent")
            shape[i] = s
        if st != registry.DYN:
            stride[i] = st + 3
            if shape[i] > 1:
                yield f"stride{i}", t.but(stride=stride), (ValueError, "has stride")
            elif s != registry.DYN:
                yield f"ok_stride{i}", t.but(stride=stride), None
            if s == registry.DYN:  # make the mode non-trivial, keeping its divisibility
                shape[i] = max(shape[i], 2 * div[i])
                yield f"stride{i}_wide", t.but(shape=shape, stride=stride), (ValueError, "has stride")
                shape[i] = t.shape[i]
            stride[i] = t.stride()[i]
        elif a.stride_divisibility > 1:
            shape[i] = max(shape[i], 2 * div[i])
            stride[i] = stride[i] + 1
            yield f"stride_div{i}", t.but(shape=shape, stride=stride), (ValueError, "not a multiple of")
            shape[i], stride[i] = t.shape[i], t.stride()[i]
        if s == registry.DYN and div[i] > 1:
            shape[i] += 1
            yield f"extent_div{i}", t.but(shape=shape), (ValueError, "not a multiple of")


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_packed_path_raises_every_check(name):
    """Each check raises from launch as from launch_ctypes (type and text), on a fresh library and on
    one that has launched a valid call before (a cached signature), and launches nothing."""
    spec = registry.SPECS_BY_NAME[name]
    rng = random.Random(name + "bad")
    n = 0
    for k, a in enumerate(spec.args):
        if isinstance(a, registry.ScalarArg):
            continue
        good = rand_args(spec, rng)
        for label, bad, want in mutations(a, good[k]):
            args = good[:k] + [bad] + good[k + 1:]
            if want is None:  # allowed: both paths launch, same bytes
                assert same_bytes(name, args, 3), label
                continue
            with pytest.raises(want[0], match=want[1]) as oracle:
                make_lib().launch_ctypes(name, *args, stream=3)
            for warm in (False, True):
                lib = make_lib()
                if warm:
                    lib.launch(name, *good, stream=3)
                    lib.launch(name, *good, stream=3)  # now a cached signature
                calls = len(lib._fns[name].calls)
                with pytest.raises(want[0], match=want[1]) as e:
                    lib.launch(name, *args, stream=3)
                assert str(e.value) == str(oracle.value) and type(e.value) is type(oracle.value), label
                assert len(lib._fns[name].calls) == calls, f"{label}: launched despite the error"
                n += 1
    assert n >= 8


def test_ok_mutations_launch():
    """The checks ignore the fixed stride of an extent-1 mode: both paths launch, same bytes."""
    spec = registry.SPECS_BY_NAME["mok_gemm_bk"]
    rng = random.Random(7)
    good = rand_args(spec, rng)
    bad = good[0].but(stride=good[0].stride()[:2] + (12345,))
    args = [bad] + good[1:]
    assert same_bytes(spec.name, args, 1)


def test_argument_count_and_unknown_kernel():
    lib = make_lib()
    spec = registry.SPECS_BY_NAME["mok_combine"]
    args = rand_args(spec, random.Random(0))
    for how in ("launch", "launch_ctypes"):
        with pytest.raises(TypeError, match="mok_combine takes 6 arguments, got 3"):
            getattr(lib, how)("mok_combine", *args[:3], stream=0)
        with pytest.raises(KeyError):
            getattr(lib, how)("mok_nope", *args, stream=0)
    assert lib._fns["mok_combine"].calls == []


def test_scalars_and_streams_the_packed_format_does_not_take():
    """float overflow gives inf, stream None is NULL, a float or tensor int32 is truncated: as ctypes does; an
    int32 scalar out of range raises on both paths (ctypes used to wrap it silently: 2**31 + 5 became negative)."""
    spec = registry.SPECS_BY_NAME["mok_gemm_gate_up_swiglu_ef"]  # ..., limit (f32), group_m (i32)
    rng = random.Random(3)
    for limit, group_m, stream in [(1e300, 2**31 - 1, None), (-1e300, -(2**31), 0), (7, 3.9, 2**64 - 1),
                                   (torch.tensor(2.5), torch.tensor(4), 12)]:
        args = rand_args(spec, rng)
        args[-2], args[-1] = limit, group_m
        assert same_bytes(spec.name, args, stream)
    lib = make_lib()
    for group_m in (2**31 + 5, -(2**40) - 1):
        args = rand_args(spec, rng)
        args[-1] = group_m
        for how in ("launch", "launch_ctypes"):
            with pytest.raises(ValueError, match="group_m: .* does not fit an int32"):
                getattr(lib, how)(spec.name, *args, stream=0)


def test_launch_error_code():
    lib = make_lib(rc=700)
    args = rand_args(registry.SPECS_BY_NAME["mok_combine"], random.Random(0))
    for how in ("launch", "launch_ctypes"):
        with pytest.raises(loader.KernelLibraryError, match=r"mok_combine failed to launch: error 700 \(700\)"):
            getattr(lib, how)("mok_combine", *args, stream=0)


def test_real_tensors():
    """Real (CPU) torch tensors: both paths reject them with the same text."""
    spec = registry.SPECS_BY_NAME["mok_gather_rows"]  # src, idx, tile_expert, dst, num_ctas
    src = torch.randn(10, 24).bfloat16()
    args = [src, torch.arange(4), torch.zeros(1, dtype=torch.int32), torch.empty(4, 24, dtype=torch.bfloat16), 1]
    for how in ("launch", "launch_ctypes"):
        with pytest.raises(ValueError, match="mok_gather_rows.src: must be a CUDA tensor"):
            getattr(make_lib(), how)(spec.name, *args, stream=0)


def test_check_launch_args_for_cpu_stubs():
    """loader.check_launch_args (what the tests' CPU stub libraries apply to every launch): real CPU tensors that
    fit mok_combine's spec pass; a wrong dtype, rank, count, misaligned view, non-int scalar or an int32 out of
    range raise, as the real launch would reject them (it also asks for CUDA tensors unless on_device=False)."""
    T, k, H, R = 5, 2, 16, 12
    rows = torch.randn(R, H).bfloat16()
    pos = torch.randint(0, R, (T, k))
    w = torch.rand(T, k)
    ids = torch.randint(0, 8, (T, k))
    out = torch.empty(T, H, dtype=torch.bfloat16)
    good = [rows, pos, w, ids, out, 1]
    loader.check_launch_args("mok_combine", good, on_device=False)
    with pytest.raises(ValueError, match="CUDA"):
        loader.check_launch_args("mok_combine", good)
    bad_cases = [
        (1, pos.int(), TypeError, "dtype"),
        (2, w.unsqueeze(0), ValueError, "dims"),
        (0, torch.randn(R * H + 8).bfloat16()[1:1 + R * H].view(R, H), ValueError, "aligned"),
        (5, 1.5, TypeError, "int32"),
        (5, 2**31, TypeError, "int32"),
        (5, True, TypeError, "int32"),
        (4, out.float().numpy(), TypeError, "tensor"),
    ]
    for i, value, err, what in bad_cases:
        args = list(good)
        args[i] = value
        with pytest.raises(err, match=what):
            loader.check_launch_args("mok_combine", args, on_device=False)
    with pytest.raises(TypeError, match="arguments"):
        loader.check_launch_args("mok_combine", good[:-1], on_device=False)
