// Package term is the term-fenced delivery core that the ordered relay
// (subscriber/ordered.go) and the WAL relay (walrelay) share.
//
// A Term is one ownership of a scope: a partition lease of the ordered
// relay (scope: the partition, epoch: the lease's epoch), a replication
// session of the WAL relay (scope 0, epoch: the session's number). A relay
// hands a message to its consumer only under a live term, with Term.Hand,
// which registers a Copy (the key, the message) in the relay's Ledger.
// A copy is out from Hand until it ends:
//
//   - by its verdict: the relay saw the message acked or nacked and calls
//     Copy.End, or, once the copy's term has ended, the ledger sees it;
//   - by an overrun: the relay gave up on the handler (Copy.End(Overran))
//     when the copy was overdue (Copy.Overdue: Config.Overdue after Hand,
//     the same rule for both keyed relays), or Config.Overrun passed after
//     the copy's term ended;
//   - withdrawn: the relay did not hand the message over after all;
//   - by Ledger.Close.
//
// A copy whose term ended and that is still out is stale: the ledger
// follows it (a goroutine per stale copy waits for the message's verdict,
// the overrun or Close), holds its key back, and signals Ledger.Freed when
// it ends.
//
// # Invariants
//
// Each is checked by the tests named beside it (term_test.go); the relays'
// tests check that they hold end to end (docs/ARCHITECTURE.md, "The term
// core").
//
//   - One copy per key: at most one copy of a key is out in a ledger at
//     any time, across all its terms, live or ended. Hand refuses a key that
//     has a copy out (ErrKeyOut); a relay asks Ledger.Stale before it hands
//     a key out, and the ordered relay takes a partition again only once the
//     partition's ended terms have quiesced (Ledger.Quiesced).
//     TestOneCopyPerKeyAcrossTerms, TestConcurrentHandsKeepOneCopyPerKey.
//   - A term's end cancels its messages: Term.End (and Ledger.Close, and
//     Begin of the same scope) cancels the context of every message handed
//     out under the term and still out, before it returns, and Hand under an
//     ended term fails (ErrEnded). A message's context also ends with its
//     copy. TestEndCancelsEveryCopy, TestBeginEndsThePreviousTermOfItsScope.
//   - A verdict of an ended term is not progress: Copy.End reports true
//     only for the call that ended the copy while its term was live; a relay
//     records a verdict only then, and the write itself is fenced on the
//     term: inside Term.Enter, which fails once the term has ended and keeps
//     the term from quiescing until the write is done, and, for the ordered
//     relay, in statements fenced on owner and epoch (the WAL relay's
//     session loop applies verdicts only before it ends its term, in
//     statements fenced on the session's walsender: walrelay's write
//     fence). The verdicts of stale copies reach the ledger only.
//     TestVerdictOfAnEndedTermIsNotLive, TestEnterHoldsQuiescence.
//   - Nothing waits forever: a stale copy ends by its verdict, by
//     Config.Overrun after its term ended, or by Close; each end signals
//     Freed. A live copy is overdue Config.Overdue after Hand (Copy.Overdue),
//     and its relay then ends it. Close ends every term and copy, releases
//     every waiter and returns once the ledger's goroutines have ended; it
//     is idempotent. TestStaleCopyEndsByVerdict, TestStaleCopyEndsByOverrun,
//     TestLiveCopyOverdue, TestCloseEndsEverything,
//     TestWithdrawnCopyFreesItsKey.
//   - A message counts until its handler returns: a copy ended by an
//     overrun frees its key, but its message lingers (Ledger.Lingering,
//     which the relays count against MaxInFlight with the stale copies)
//     until its verdict or Close, and Freed signals its end.
//     TestOverrunCopyLingersUntilItsVerdict.
//   - Quiescence: a term has quiesced when it ended, every copy handed
//     out under it ended and every Enter under it left (Term.Quiesced); a
//     scope has quiesced when every ended term of it has (Ledger.Quiesced).
//     TestQuiescence, TestEnterHoldsQuiescence.
package term
