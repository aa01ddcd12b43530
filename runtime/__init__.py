"""What every layer of kvtier uses and none of them owns: CPU affinity and priorities, thread lanes and
hand-offs to the event loop, the event loop's choice, and mount facts. Imports nothing of kvtier's."""
