package router

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/subscriber"
)

// ErrNoSubscribers is returned by InProcess.Publish when no one is
// subscribed to the topic: an outbox must not treat a dropped message as
// delivered. It comes wrapped with subscriber.Permanent (there is no route for
// the topic), so the relay parks the row dead at once; replay it once a
// consumer subscribes.
var ErrNoSubscribers = errors.New("router: no subscribers for the topic")

// ErrInProcessClosed is returned after InProcess.Close.
var ErrInProcessClosed = errors.New("router: in-process pub/sub is closed")

// InProcess is an in-memory Watermill pub/sub with the dispatch contract an
// outbox needs (docs/ARCHITECTURE.md, "In-process dispatch"): Publish hands each message to
// every subscriber of the topic and returns only when all of them acked; a
// nack (a handler error or panic, through a router) is Publish's error, with
// the handler's error when the consumer's router uses
// subscriber.CaptureError; no subscriber is ErrNoSubscribers. Unlike
// GoChannel it never acks on the consumer's behalf.
type InProcess struct {
	// AckTimeout bounds how long Publish waits for a subscriber's verdict.
	// Defaults to 30s.
	AckTimeout time.Duration

	mu     sync.RWMutex
	subs   map[string]map[*inprocSub]struct{}
	closed bool
	wg     sync.WaitGroup
}

type inprocSub struct {
	ch     chan *message.Message
	done   chan struct{}
	closed bool
}

var (
	_ message.Publisher  = (*InProcess)(nil)
	_ message.Subscriber = (*InProcess)(nil)
)

// NewInProcess returns an empty InProcess pub/sub.
func NewInProcess() *InProcess { return &InProcess{subs: map[string]map[*inprocSub]struct{}{}} }

// Subscribe registers a subscriber of topic until ctx is done or Close.
func (p *InProcess) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrInProcessClosed
	}
	s := &inprocSub{ch: make(chan *message.Message), done: make(chan struct{})}
	if p.subs[topic] == nil {
		p.subs[topic] = map[*inprocSub]struct{}{}
	}
	p.subs[topic][s] = struct{}{}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		select {
		case <-ctx.Done():
		case <-s.done:
		}
		p.mu.Lock()
		delete(p.subs[topic], s)
		p.mu.Unlock()
		p.closeSub(s)
	}()
	return s.ch, nil
}

func (p *InProcess) closeSub(s *inprocSub) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !s.closed {
		s.closed = true
		close(s.ch)
	}
}

// Publish delivers msgs to every subscriber of topic, one message at a time,
// and waits for their acks.
func (p *InProcess) Publish(topic string, msgs ...*message.Message) error {
	timeout := p.AckTimeout
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	for _, msg := range msgs {
		p.mu.RLock()
		if p.closed {
			p.mu.RUnlock()
			return ErrInProcessClosed
		}
		subs := make([]*inprocSub, 0, len(p.subs[topic]))
		for s := range p.subs[topic] {
			subs = append(subs, s)
		}
		p.mu.RUnlock()
		if len(subs) == 0 {
			// No route for the topic: the row goes dead at once instead of
			// retrying 25 times into the void.
			return subscriber.Permanent(fmt.Errorf("topic %q: %w", topic, ErrNoSubscribers))
		}
		var errs []error
		for _, s := range subs {
			if err := p.deliver(s, msg, timeout); err != nil {
				errs = append(errs, err)
			}
		}
		if err := errors.Join(errs...); err != nil {
			return err
		}
	}
	return nil
}

func (p *InProcess) deliver(s *inprocSub, msg *message.Message, timeout time.Duration) (err error) {
	c := msg.Copy()
	parent := msg.Context()
	if parent == nil {
		parent = context.Background()
	}
	ctx, recorded := subscriber.ContextWithErrorRecorder(parent)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	c.SetContext(ctx)
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	defer func() {
		// The subscriber went away between the snapshot and the send (its
		// channel closed): not delivered.
		if recover() != nil {
			err = ErrNoSubscribers
		}
	}()
	select {
	case s.ch <- c:
	case <-s.done:
		return ErrNoSubscribers
	case <-timer.C:
		return fmt.Errorf("subscriber did not take the message within %s", timeout)
	}
	select {
	case <-c.Acked():
		return nil
	case <-c.Nacked():
		if err := recorded(); err != nil {
			return fmt.Errorf("subscriber nacked: %w", err)
		}
		return errors.New("subscriber nacked the message")
	case <-timer.C:
		return fmt.Errorf("subscriber did not ack within %s", timeout)
	}
}

// Close ends every subscription. It is idempotent.
func (p *InProcess) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	var all []*inprocSub
	for _, set := range p.subs {
		for s := range set {
			all = append(all, s)
		}
	}
	p.mu.Unlock()
	for _, s := range all {
		close(s.done)
	}
	p.wg.Wait()
	return nil
}
