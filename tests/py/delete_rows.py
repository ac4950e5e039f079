"""Delete the rows matching a predicate from a Delta table with Python
deltalake (another writer's DELETE), printing the new version."""
import os
import sys

import deltalake

table, predicate = sys.argv[1], sys.argv[2]
dt = deltalake.DeltaTable(table)
dt.delete(predicate)
print(dt.version(), flush=True)
os._exit(0)
