package walrelay_test

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestWALMalformedFrameEndsTheSession: the server's replication stream,
// seen through a proxy that cuts the first Relation message short (as
// issue 46 found it), ends the session with an error, never the process;
// the relay counts it in outbox_wal_malformed_frames_total, starts a new
// session, and the event is delivered.
func TestWALMalformedFrameEndsTheSession(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	proxy := &cuttingProxy{upstream: net.JoinHostPort(pool.Config().ConnConfig.Host, strconv.Itoa(int(pool.Config().ConnConfig.Port)))}
	addr := proxy.start(t)
	cfg := pool.Config().Copy()
	host, port, _ := net.SplitHostPort(addr)
	p, _ := strconv.ParseUint(port, 10, 16)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = host, uint16(p), nil, nil
	proxied, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxied.Close)
	s := relay(t, proxied, tbl, nil)
	reg := prometheus.NewRegistry()
	reg.MustRegister(s.Collector())
	rec := newRecorder()
	rec.consume(t, s, nil)
	ids := enqueue(t, pool, tbl, "k1", "")
	rec.waitAcked(t, ids, 30*time.Second)
	if n := proxy.cut.Load(); n != 1 {
		t.Fatalf("the proxy cut %d Relation messages, want 1", n)
	}
	got, err := testutil.GatherAndCount(reg, "outbox_wal_malformed_frames_total")
	if err != nil || got != 1 {
		t.Fatalf("outbox_wal_malformed_frames_total: %d series (%v)", got, err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "outbox_wal_malformed_frames_total" {
			if v := mf.GetMetric()[0].GetCounter().GetValue(); v != 1 {
				t.Fatalf("outbox_wal_malformed_frames_total = %v, want 1", v)
			}
		}
	}
}

// cuttingProxy forwards connections to upstream and cuts the first
// Relation message a replication stream sends (a CopyData holding XLogData
// whose message is 'R') 3 bytes short of its end, inside its last column.
type cuttingProxy struct {
	upstream string
	cut      atomic.Int32
	wg       sync.WaitGroup
}

func (p *cuttingProxy) start(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		p.wg.Wait()
	})
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", p.upstream)
			if err != nil {
				_ = c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, u)
			mu.Unlock()
			p.wg.Add(2)
			go func() {
				defer p.wg.Done()
				_, _ = io.Copy(u, c)
				_ = u.Close()
			}()
			go func() {
				defer p.wg.Done()
				p.serverToClient(c, u)
				_ = c.Close()
			}()
		}
	}()
	return ln.Addr().String()
}

// serverToClient copies the server's messages (type byte, length, body) to
// the client, cutting the first Relation message.
func (p *cuttingProxy) serverToClient(c, u net.Conn) {
	hdr := make([]byte, 5)
	for {
		if _, err := io.ReadFull(u, hdr); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(hdr[1:])) - 4
		if n < 0 {
			return
		}
		body := make([]byte, n)
		if _, err := io.ReadFull(u, body); err != nil {
			return
		}
		// CopyData: 'w', 24 bytes of XLogData header, then the message.
		if hdr[0] == 'd' && len(body) > 36 && body[0] == 'w' && body[25] == 'R' && p.cut.CompareAndSwap(0, 1) {
			body = body[:len(body)-3] // inside the last column's type modifier
			binary.BigEndian.PutUint32(hdr[1:], uint32(len(body)+4))
		}
		if _, err := c.Write(append(append([]byte(nil), hdr...), body...)); err != nil {
			return
		}
	}
}
