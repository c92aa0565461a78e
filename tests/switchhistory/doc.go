// Package switchhistory holds the cross-mode history checker (issue 54,
// `make switch_history`): one table on a private wal_level=logical
// PostgreSQL cluster, relays of the three modes (default, ordered, WAL)
// started, closed and killed, the table switched between every pair of
// modes by each documented path, operators skipping, replaying and
// cleaning at random, and every promise about the events checked while it
// runs and at quiescence. The package has no code of its own: the checker
// is its test, TestSwitchHistory.
package switchhistory
