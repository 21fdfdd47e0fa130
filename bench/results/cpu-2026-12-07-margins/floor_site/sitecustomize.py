import os
if os.environ.get("FLOOR"):
    import torch
    from dataclasses import replace
    from kvbuffer.validate import tolerances as T
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        T.TOLERANCES[dt] = replace(T.TOLERANCES[dt], floor=float(os.environ["FLOOR"]))
