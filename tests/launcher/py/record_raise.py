# A worker that raises inside @record on rank 1; rank 0 waits to be stopped. The launcher must
# report rank 1's traceback as the root cause.
import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank 1")
    time.sleep(60)


if __name__ == "__main__":
    main()
