"""A step that imports what example scripts pull in lazily (HF stack and friends) and reports
the seconds its own imports took."""
import importlib
import time

start = time.perf_counter()
found = []
for name in ("transformers", "tokenizers", "huggingface_hub", "datasets", "accelerate", "pandas",
             "safetensors", "scipy.stats", "sklearn"):
    try:
        importlib.import_module(name)
        found.append(name)
    except Exception:
        pass
print(f"step imports: {time.perf_counter() - start:.2f} s ({', '.join(found)})", flush=True)
