"""ONNX Runtime's MatMulInteger (u8 x i8 -> i32, the integer GEMM alone) on the shapes of
`cargo bench -p qforge-kernels --bench gemm`, 2 intra-op threads. Run by scripts/bench.sh
with the test venv; writes target/ort-gemm.json as {"shape/M": multiply-accumulates per s}.
"""

import json
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ALL_M = (1, 16, 128, 512)
SHAPES = [("smollm2_q_proj_576x576", 576, 576, ALL_M),
          ("smollm2_gate_proj_1536x576", 1536, 576, ALL_M),
          ("smollm2_down_proj_576x1536", 576, 1536, ALL_M),
          ("smollm2_lm_head_49152x576", 49152, 576, (1, 16)),
          ("llama3_8b_q_proj_4096x4096", 4096, 4096, ALL_M),
          ("llama3_8b_k_proj_1024x4096", 1024, 4096, ALL_M),
          ("llama3_8b_gate_proj_14336x4096", 14336, 4096, ALL_M),
          ("llama3_8b_down_proj_4096x14336", 4096, 14336, ALL_M)]


def session(n, k, rng):
    # ±63 (any values cost ORT the same).
    weight = rng.integers(-63, 64, size=(k, n), dtype=np.int8)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "a_zero"], ["y"])], "gemm",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", n])],
        initializer=[numpy_helper.from_array(weight, "w"),
                     numpy_helper.from_array(np.array(128, dtype=np.uint8), "a_zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def main():
    rng = np.random.default_rng(0)
    result = {}
    for name, n, k, ms in SHAPES:
        sess = session(n, k, rng)
        for m in ms:
            a = rng.integers(0, 256, size=(m, k), dtype=np.uint8)
            for _ in range(5):
                sess.run(None, {"a": a})
            runs, start = 0, time.perf_counter()
            while time.perf_counter() - start < 1.0:
                sess.run(None, {"a": a})
                runs += 1
            seconds = (time.perf_counter() - start) / runs
            result[f"{name}/{m}"] = m * n * k / seconds
    with open("target/ort-gemm.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
