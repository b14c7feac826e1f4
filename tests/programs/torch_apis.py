"""torch's own APIs, one line each: what a step that uses them prints, or the error it got.
torch.compile's tracing, custom operators and quantization look operators up under torch.ops,
which torch puts into sys.modules itself; the last line brings megatron.core and modelopt."""
import torch


@torch.library.custom_op("torch_apis::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


class Relu2(torch.nn.Module):
    def forward(self, x):
        return x.relu() * 2


def quantized_mtq():
    import megatron.core  # noqa: F401
    import modelopt.torch.quantization as mtq
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    return type(mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(torch.ones(1, 4)))[0]).__name__


CHECKS = {
    "torch.ops": lambda: (str(torch.ops.aten.add.default), torch.classes.__name__),
    "jit.script": lambda: torch.jit.script(torch.nn.Linear(2, 2)).code.split("(")[0],
    "fx": lambda: [node.op for node in torch.fx.symbolic_trace(Relu2()).graph.nodes],
    "export": lambda: len(torch.export.export(Relu2(), (torch.ones(2),)).graph.nodes),
    "custom_op": lambda: torch.ops.torch_apis.twice(torch.ones(2)).tolist(),
    "compile(aot_eager)": lambda: torch.compile(lambda x: twice(x).sin(), backend="aot_eager")(
        torch.ones(2)).tolist(),
    "compile(inductor)": lambda: round(torch.compile(lambda x: (x * 3).cos().sum())(
        torch.ones(8)).item(), 4),
    "quantize_dynamic": lambda: type(torch.ao.quantization.quantize_dynamic(
        torch.nn.Sequential(torch.nn.Linear(4, 4)), {torch.nn.Linear}, dtype=torch.qint8)[0]).__name__,
    "vmap": lambda: torch.func.vmap(torch.sin)(torch.zeros(3)).tolist(),
    "jacobian": lambda: torch.autograd.functional.jacobian(lambda x: x ** 2, torch.ones(2)).tolist(),
    "modelopt": quantized_mtq,
}

for name, check in CHECKS.items():
    try:
        print(f"check {name}: {check()}", flush=True)
    except Exception as error:  # the same program plainly says what a fresh interpreter got
        print(f"check {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
