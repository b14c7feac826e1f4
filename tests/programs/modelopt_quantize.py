import time; t=time.time()
import torch
import modelopt.torch.quantization as mtq
m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x = torch.randn(8, 16)
m = mtq.quantize(m, mtq.INT8_DEFAULT_CFG, lambda mm: mm(x))
print("quantized", type(m[0]).__name__, m(x).shape, round(time.time()-t,2))
