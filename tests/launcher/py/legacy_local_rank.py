# The legacy torch.distributed.launch convention, as in the PyTorch tutorials: the launcher passes
# --local_rank=N (torch 2.x: --local-rank=N) and the script reads it with argparse. Needs no torch.
import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
parser.add_argument("rest", nargs="*")
args = parser.parse_args()
print(f"local_rank={args.local_rank} LOCAL_RANK={os.environ['LOCAL_RANK']} rest={args.rest}")
