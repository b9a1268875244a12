"""Sleeps (for kill tests); a grandchild sleeps too, to check none survive."""

import subprocess
import sys
import time

import torch.distributed as dist

dist.init_process_group()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(f"grandchild {child.pid}", flush=True)
time.sleep(120)
