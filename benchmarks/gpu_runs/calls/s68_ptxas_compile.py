# Session 68: compile a dumped Triton IR file for sm_90a with Triton 3.6 and print ptxas -v's registers and spills.
# Usage (a venv with pip triton==3.6.*, no GPU needed): python s68_ptxas_compile.py FILE.ttir WARPS STAGES
import sys, triton, re, subprocess, os
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
ptx = k.asm["ptx"]
open(path + ".ptx", "w").write(ptx)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path + ".ptx", "-o", "/dev/null"], capture_output=True, text=True)
print(os.path.basename(path), warps, [l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l])
