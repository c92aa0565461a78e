package forwarder

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// BatchPublisher is a publisher that publishes many messages of one topic
// in one call, in as few broker round trips as its client allows, and
// reports the outcome of each message. kafkabackend's and amqpbackend's
// publishers implement it. A Forwarder publishing to a BatchPublisher batches by default (see
// Config.BatchSize).
type BatchPublisher interface {
	message.Publisher
	// PublishBatch publishes msgs to topic, keeping their order among the
	// messages of one partition key, and returns nil when the broker has
	// every message, else one entry per message of msgs: nil for a message
	// the broker has, its error for one it does not.
	PublishBatch(topic string, msgs []*message.Message) []error
}

// PublishBatchSizeDefault is Config.BatchSize for a BatchPublisher.
const PublishBatchSizeDefault = 100

// MaxPublishesDefault is Config.MaxPublishes.
const MaxPublishesDefault = 4

// queued is one message waiting in the batcher for its publish.
type queued struct {
	dest string
	out  *message.Message
	done chan error // buffered: the flusher never waits
	// taken is set, under batcher.mu, when a flusher took the message.
	taken bool
}

// batcher gathers the messages handed to it by concurrent handler calls into
// publish calls of up to size messages per destination topic, with at most
// publishes calls under way (group commit). A message that finds fewer calls
// under way starts a flusher goroutine, which publishes what has queued up,
// oldest first, until the queue is empty, and ends; so a message alone is
// published at once, messages that arrive while calls are under way share
// the next one, and nothing runs while nothing is queued. There is no timer.
type batcher struct {
	size      int
	publishes int
	publish   func(dest string, msgs []*message.Message) []error

	mu       sync.Mutex
	queue    []*queued
	flushers int
}

func newBatcher(pub message.Publisher, size, publishes int) *batcher {
	b := &batcher{size: size, publishes: publishes}
	if bp, ok := pub.(BatchPublisher); ok {
		b.publish = bp.PublishBatch
	} else {
		// One Publish(topic, msgs...) call: a failed call fails every
		// message in it.
		b.publish = func(dest string, msgs []*message.Message) []error {
			if err := pub.Publish(dest, msgs...); err != nil {
				return fill(len(msgs), err)
			}
			return nil
		}
	}
	return b
}

// submit queues out for dest and returns once a publish call carried it: nil
// when the broker has it, else the error of that message. It returns ctx's
// error when ctx ends first (the message may still be published by a call
// already under way; delivery is at least once).
func (b *batcher) submit(ctx context.Context, dest string, out *message.Message) error {
	q := &queued{dest: dest, out: out, done: make(chan error, 1)}
	b.mu.Lock()
	b.queue = append(b.queue, q)
	if b.flushers < b.publishes {
		b.flushers++
		go b.flush()
	}
	b.mu.Unlock()
	select {
	case err := <-q.done:
		return err
	case <-ctx.Done():
	}
	b.mu.Lock()
	if !q.taken {
		b.queue = slices.DeleteFunc(b.queue, func(e *queued) bool { return e == q })
		b.mu.Unlock()
		return fmt.Errorf("no publish call took it: %w", ctx.Err())
	}
	b.mu.Unlock()
	return fmt.Errorf("the publish call carrying it did not return: %w", ctx.Err())
}

// flush publishes batches from the queue until it is empty.
func (b *batcher) flush() {
	for {
		b.mu.Lock()
		n := min(len(b.queue), b.size)
		if n == 0 {
			b.flushers--
			b.mu.Unlock()
			return
		}
		batch := slices.Clone(b.queue[:n])
		b.queue = slices.Delete(b.queue, 0, n)
		for _, q := range batch {
			q.taken = true
		}
		b.mu.Unlock()
		b.send(batch)
	}
}

// send publishes batch with one call per destination topic (in queue order
// within a topic) and hands every message its result.
func (b *batcher) send(batch []*queued) {
	for len(batch) > 0 {
		dest := batch[0].dest
		var group, rest []*queued
		for _, q := range batch {
			if q.dest == dest {
				group = append(group, q)
			} else {
				rest = append(rest, q)
			}
		}
		msgs := make([]*message.Message, len(group))
		for i, q := range group {
			msgs[i] = q.out
		}
		errs := b.publishSafely(dest, msgs)
		for i, q := range group {
			var err error
			if errs != nil {
				err = errs[i]
			}
			q.done <- err
		}
		batch = rest
	}
}

// publishSafely calls publish and turns a panic or a result of the wrong
// length into an error for every message, so that no handler waits forever.
func (b *batcher) publishSafely(dest string, msgs []*message.Message) (errs []error) {
	defer func() {
		if r := recover(); r != nil {
			errs = fill(len(msgs), fmt.Errorf("publish panicked: %v", r))
		}
	}()
	errs = b.publish(dest, msgs)
	if errs != nil && len(errs) != len(msgs) {
		return fill(len(msgs), fmt.Errorf("the publisher reported %d results for %d messages", len(errs), len(msgs)))
	}
	return errs
}

func fill(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}
