# Reads a trun --event-log file with torchelastic's own Event.deserialize and prints, per line:
# "<name> <source> <timestamp > 0> <run_id>". Exits 1 on the first line it cannot read.
import sys

from torch.distributed.elastic.events.api import Event, EventSource

with open(sys.argv[1]) as f:
    for number, line in enumerate(f, 1):
        try:
            event = Event.deserialize(line.strip())
        except Exception as e:  # noqa: BLE001 - the line number and the reason are the point
            print(f"line {number}: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
        assert event.source == EventSource.AGENT
        print(event.name, event.source.value, event.timestamp > 0, event.metadata["run_id"])
