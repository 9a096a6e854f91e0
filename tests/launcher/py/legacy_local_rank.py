# The legacy torch.distributed.launch convention, as in the PyTorch tutorials: the launcher passes
# --local_rank=N (torch 2.x: --local-rank=N) and the script reads it with argparse. Needs no torch.
import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
parser.add_argument("rest", nargs="*")
args = parser.parse_args()
# One write per line: trun runs scripts with python -u, where print() writes the text and the
# newline separately, so two workers' lines could interleave on the shared stdout.
sys.stdout.write(f"local_rank={args.local_rank} LOCAL_RANK={os.environ['LOCAL_RANK']} rest={args.rest}\n")
