"""%load_ext gpuwire / %gpuwire attach in a real IPython shell (in a subprocess)."""

import os
import subprocess
import sys
import textwrap


def test_ipython_magic_attaches_with_cuda_compat(node):
    code = textwrap.dedent(f"""
        from IPython.testing.globalipapp import start_ipython
        ip = start_ipython()
        ip.run_line_magic("load_ext", "gpuwire")
        print(ip.run_line_magic("gpuwire", "attach --node {node.address}"))
        ip.run_cell("import torch; x = torch.ones(3, device='cuda') * 2; print('sum', x.sum().item(), x.device)")
        print(ip.run_line_magic("gpuwire", "status"))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "GPUWIRE_NODE": ""})
    assert "gpuwire: attached to" in result.stdout, result.stdout + result.stderr
    assert "sum 6.0 cuda:0" in result.stdout
    assert "round trips" in result.stdout
