package subscriber

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
)

// Death notices. A row that goes dead without its failure reaching the
// router (the lease of its last allowed attempt expired: its relay was
// killed, hung or cut off; or its relay stopped before the handler
// answered) is parked dead by a claim, a take-back or a release, which
// records its death notice in the same statement (<table>_dead_notices,
// migration 000015). A subscription whose consumer refuses dead letters
// (the forwarder, subscription.deadLetters) hands each notice to the
// router as the dead row's message carrying its cause
// (deadletter.WithCause): the forwarder refuses it, so the router's poison
// queue copies it, and the notice is deleted when the router has answered
// (ack or nack alike: the row stays dead, never marked published). A
// notice is leased for one delivery at a time (renewed like a row's lease
// while the router has it), so relays sharing the table deliver it once;
// a delivery whose verdict does not come back is counted, and a notice is
// delivered at most sqlq.NoticeTries times.
//
// The relay looks for due notices when it starts delivering (a
// subscription, or a standby that becomes the leader), when it has parked
// a row dead itself, and every noticeEvery besides (another relay's
// release, a notice whose delivery got no verdict).

// noticeEvery is how often a subscription that delivers death notices
// looks for due ones that nothing announced, for a LockTTL of ttl: ttl/4
// (the bounded claim's sweep's period), at least a second.
func noticeEvery(ttl time.Duration) time.Duration { return max(ttl/4, time.Second) }

// noticeLoop delivers the table's due death notices to the consumer until
// the subscription stops.
func (sub *subscription) noticeLoop(stop <-chan struct{}) {
	s := sub.s
	if s.q.ClaimNotices == "" {
		sub.logger.Info("The table has no "+sqlq.DeadNoticesTable(s.cfg.Table)+" (migration 000015): a row whose lease expires on its last "+
			"attempt is parked dead without reaching the router's poison queue; apply it (schema.Migrate or `outbox migrate`) and restart the relay", nil)
		return
	}
	wake := s.notices.register()
	defer s.notices.unregister(wake)
	t := time.NewTicker(noticeEvery(s.cfg.LockTTL))
	defer t.Stop()
	for {
		if s.IsLeader() && !sub.deliverNotices(stop) {
			return
		}
		select {
		case <-stop:
			return
		case <-wake:
		case <-t.C:
		}
	}
}

// deliverNotices hands the due notices to the consumer, a batch at a time,
// while slots are free; it returns false when the subscription stopped.
func (sub *subscription) deliverNotices(stop <-chan struct{}) bool {
	s := sub.s
	for {
		n := sub.slots.Reserve(s.cfg.BatchSize)
		if n == 0 {
			return true // full: the next tick or wake-up
		}
		notices, err := sub.claimNotices(n)
		if err != nil {
			sub.slots.Unreserve(n)
			if sub.ctx.Err() == nil {
				sub.logger.Error("Could not claim death notices; retrying later", err, nil)
			}
			return true
		}
		var leased []*sqlq.ClaimedNotice
		for _, nt := range notices {
			if nt.Lease == nil {
				sub.logger.Error("Death notice dropped: it was handed to the router "+fmt.Sprint(nt.Tries)+" times without an answer (its relay was killed or stopped each time); "+
					"the row stays dead without a poison copy: find it with `outbox dead list`", errors.New(nt.Cause),
					watermill.LogFields{"event_id": nt.Row.EventID, "sequence": nt.Row.Sequence})
				continue
			}
			leased = append(leased, nt)
		}
		sub.slots.Unreserve(n - len(leased))
		for i, nt := range leased {
			if !sub.handNotice(nt, stop) {
				for _, rest := range leased[i+1:] {
					sub.giveBackNotice(rest)
				}
				sub.slots.Unreserve(len(leased) - i - 1)
				return false
			}
		}
		if len(notices) < n {
			return true
		}
	}
}

// claimNotices leases up to n due death notices of topic's rows.
func (sub *subscription) claimNotices(n int) ([]*sqlq.ClaimedNotice, error) {
	s := sub.s
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	query, args := s.q.ClaimNotices, []any{sqlq.NoticeTries, s.cfg.LockTTL.Seconds(), n}
	if sub.topic != AllTopics {
		query, args = s.q.ClaimNoticesTopic, append(args, sub.topic)
	}
	rows, err := s.pool.Query(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("claim death notices of %s: %w", s.cfg.Table, err)
	}
	defer rows.Close()
	var out []*sqlq.ClaimedNotice
	for rows.Next() {
		nt := &sqlq.ClaimedNotice{}
		if err := nt.ScanNotice(rows, s.q.Columns); err != nil {
			return nil, err
		}
		out = append(out, nt)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim death notices of %s: %w", s.cfg.Table, err)
	}
	return out, nil
}

// noticeCause is the cause a death notice's message carries: why its row
// died, as its last_error says.
func noticeCause(lastError string) error {
	return fmt.Errorf("dead without its failure reaching the router (handed to it only for its poison queue): %s", lastError)
}

// handNotice hands one leased notice to the consumer and starts its
// watcher; it returns false, the notice given back, when the subscription
// stopped first. The notice's slot is reserved.
func (sub *subscription) handNotice(nt *sqlq.ClaimedNotice, stop <-chan struct{}) bool {
	s := sub.s
	msg, err := nt.Row.Message(s.cfg.Table)
	if err != nil {
		msg = nt.Row.MessageWithoutHeaders(s.cfg.Table)
	}
	ctx, cancel := context.WithCancel(deadletter.WithCause(context.WithoutCancel(sub.ctx), noticeCause(nt.Cause)))
	msg.SetContext(ctx)
	select {
	case sub.out <- msg:
		sub.watchers.Add(1)
		go sub.watchNotice(nt, msg, cancel)
		return true
	case <-stop:
		cancel()
		sub.giveBackNotice(nt)
		sub.slots.Unreserve(1)
		return false
	}
}

// watchNotice waits for the router's answer to a notice and deletes the
// notice then; it renews the notice's lease meanwhile, as watch renews a
// row's, until the overrun. Without an answer (CloseTimeout after the
// subscription stopped) the lease is left to run out: the delivery
// counts, and the notice comes back.
func (sub *subscription) watchNotice(nt *sqlq.ClaimedNotice, msg *message.Message, cancel context.CancelFunc) {
	s := sub.s
	defer func() {
		cancel()
		sub.slots.Unreserve(1)
		sub.watchers.Done()
	}()
	lease := *nt.Lease
	var renew <-chan time.Time
	if !s.cfg.DisableLeaseExtension {
		t := time.NewTicker(s.cfg.LockTTL / 2)
		defer t.Stop()
		renew = t.C
	}
	overrun := time.NewTimer(s.overrunAfter())
	defer overrun.Stop()
	stop := sub.stopped()
	var grace <-chan time.Time
	fields := watermill.LogFields{"event_id": nt.Row.EventID, "sequence": nt.Row.Sequence}
	for {
		select {
		case <-msg.Acked():
			sub.noticeDone(nt, lease, "acked", fields)
			return
		case <-msg.Nacked():
			sub.noticeDone(nt, lease, "nacked", fields)
			return
		case <-renew:
			next, ok := sub.renewNotice(nt, lease)
			if !ok {
				renew = nil
				continue
			}
			lease = next
		case <-overrun.C:
			cancel()
			renew = nil
			sub.logger.Error("The router did not answer a death notice within the dispatch timeout; its lease runs out and it is delivered again",
				s.overrunError(), fields)
		case <-stop:
			stop = nil
			grace = time.After(s.cfg.CloseTimeout)
		case <-grace:
			sub.logger.Info("Death notice not answered before the close timeout; it is delivered again after its lease", fields)
			return
		}
	}
}

// noticeDone deletes a notice the router answered.
func (sub *subscription) noticeDone(nt *sqlq.ClaimedNotice, lease time.Time, verdict string, fields watermill.LogFields) {
	s := sub.s
	ctx, cancel := context.WithTimeout(context.Background(), s.writeTimeout)
	defer cancel()
	tag, err := s.pool.Exec(ctx, s.q.NoticeDone, nt.Row.ID, lease)
	fields = fields.Add(watermill.LogFields{"verdict": verdict})
	switch {
	case err != nil:
		s.logger.Error("Could not record that the router answered a death notice; it is delivered again after its lease", err, fields)
	case tag.RowsAffected() == 0:
		s.fenceRejected("notice")
		s.logger.Info("Death notice answered after its lease passed on", fields)
	default:
		s.logger.Debug("Death notice handed to the router", fields)
	}
}

// renewNotice moves the lease of a notice still in the router LockTTL
// ahead; false when it passed on (or could not be written: then renewals
// stop and the lease runs out).
func (sub *subscription) renewNotice(nt *sqlq.ClaimedNotice, lease time.Time) (time.Time, bool) {
	s := sub.s
	ctx, cancel := context.WithTimeout(context.Background(), s.writeTimeout)
	defer cancel()
	var next time.Time
	err := s.pool.QueryRow(ctx, s.q.NoticeRenew, nt.Row.ID, lease, s.cfg.LockTTL.Seconds()).Scan(&next)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		s.fenceRejected("notice")
		return time.Time{}, false
	case err != nil:
		s.logger.Error("Could not renew the lease of a death notice", err, watermill.LogFields{"event_id": nt.Row.EventID})
		return time.Time{}, false
	}
	return next, true
}

// giveBackNotice makes a notice that was not handed over due again, its
// delivery not counted.
func (sub *subscription) giveBackNotice(nt *sqlq.ClaimedNotice) {
	s := sub.s
	ctx, cancel := context.WithTimeout(context.Background(), s.writeTimeout)
	defer cancel()
	if _, err := s.pool.Exec(ctx, s.q.NoticeGiveBack, nt.Row.ID, *nt.Lease); err != nil {
		s.logger.Error("Could not give a death notice back; it is delivered after its lease", err, watermill.LogFields{"event_id": nt.Row.EventID})
	}
}
