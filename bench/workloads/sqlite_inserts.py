#!/usr/bin/env python3
"""An ordinary app's storage pattern: SQLite rows inserted one transaction each
(rollback journal), as the smartphone storage study's apps did.

    sqlite_inserts.py DB ROWS [FULL|NORMAL|OFF]

Prints the seconds the inserts took."""
import sqlite3
import sys
import time

db, rows = sys.argv[1], int(sys.argv[2])
sync = sys.argv[3] if len(sys.argv) > 3 else "FULL"
c = sqlite3.connect(db, isolation_level=None)
c.execute(f"PRAGMA synchronous={sync}")
c.execute("PRAGMA journal_mode=DELETE")
c.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT)")
t0 = time.monotonic()
for i in range(rows):
    c.execute("BEGIN")
    c.execute("INSERT INTO t (v) VALUES (?)", (f"row {i} " + "x" * 200,))
    c.execute("COMMIT")
c.close()
print(f"{time.monotonic() - t0:.3f}")
