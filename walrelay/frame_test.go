package walrelay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgproto3"
)

// xlogFrame wraps a pgoutput message in an XLogData CopyData frame at WAL
// position 0/16B3748.
func xlogFrame(msg []byte) *pgproto3.CopyData {
	f := []byte{pglogrepl.XLogDataByteID}
	f = binary.BigEndian.AppendUint64(f, 0x16B3748)
	f = binary.BigEndian.AppendUint64(f, 0x16B3800)
	f = binary.BigEndian.AppendUint64(f, 0)
	return &pgproto3.CopyData{Data: append(f, msg...)}
}

// relationMsg is the Relation message of a table with the given columns.
func relationMsg(cols ...string) []byte {
	m := []byte{'R', 0, 0, 0x40, 0x01}
	m = append(m, "public\x00wal_outbox\x00"...)
	m = append(m, 'd')
	m = binary.BigEndian.AppendUint16(m, uint16(len(cols)))
	for i, c := range cols {
		m = append(m, byte(i%2))
		m = append(m, c...)
		m = append(m, 0)
		m = binary.BigEndian.AppendUint32(m, 25)
		m = binary.BigEndian.AppendUint32(m, 0xFFFFFFFF)
	}
	return m
}

// tupleMsg is a tuple of text columns after prefix (Insert, Update or
// Delete header).
func tupleMsg(prefix []byte, vals ...string) []byte {
	m := binary.BigEndian.AppendUint16(append([]byte(nil), prefix...), uint16(len(vals)))
	for _, v := range vals {
		m = append(m, 't')
		m = binary.BigEndian.AppendUint32(m, uint32(len(v)))
		m = append(m, v...)
	}
	return m
}

// malformedFrames are the frames issue 46 found panicking the relay's
// reader goroutine, and their kin.
func malformedFrames() map[string]*pgproto3.CopyData {
	rel := relationMsg("id", "topic", "payload")
	hugeCol := binary.BigEndian.AppendUint32([]byte{'I', 0, 0, 0x40, 0x01, 'N', 0, 1, 't'}, 0xFFFFFFF0) // 4 GiB declared, none sent
	manyCols := []byte{'I', 0, 0, 0x40, 0x01, 'N', 0xFF, 0xFF, 'n'}                                     // 65535 columns declared, one sent
	upd := tupleMsg(append([]byte{'U', 0, 0, 0x40, 0x01, 'O'}, tupleMsg(nil, "a")...), "b")
	msgWithHugeContent := binary.BigEndian.AppendUint32(append([]byte{'M', 1, 0, 0, 0, 0, 0, 0, 0, 1}, "p\x00"...), 0xFFFFFFFF)
	truncate := []byte{'T', 0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0, 1}
	return map[string]*pgproto3.CopyData{
		"XLogData with an empty message":  xlogFrame(nil),
		"XLogData header cut short":       {Data: []byte{pglogrepl.XLogDataByteID, 0, 0, 0}},
		"Relation cut after its id":       xlogFrame(rel[:5]),
		"Relation cut in its names":       xlogFrame(rel[:12]),
		"Relation cut before its count":   xlogFrame(rel[:23]),
		"Relation cut in a column":        xlogFrame(rel[:len(rel)-3]),
		"Relation declaring 65535 cols":   xlogFrame(append(rel[:23:23], 0xFF, 0xFF, 0, 'x')),
		"Insert declaring a 4 GiB value":  xlogFrame(hugeCol),
		"Insert declaring 65535 columns":  xlogFrame(manyCols),
		"Update cut in its new tuple":     xlogFrame(upd[:len(upd)-1]),
		"Update cut after its old tuple":  xlogFrame(upd[:len(upd)-len(tupleMsg(nil, "b"))-1]),
		"Delete cut after its kind":       xlogFrame([]byte{'D', 0, 0, 0x40, 0x01, 'K'}),
		"Begin cut short":                 xlogFrame([]byte{'B', 0, 0}),
		"Commit cut short":                xlogFrame([]byte{'C', 0}),
		"Truncate declaring 4G relations": xlogFrame(truncate),
		"Message declaring 4 GiB":         xlogFrame(msgWithHugeContent),
		"Message without its prefix end":  xlogFrame([]byte{'M', 1, 0, 0, 0, 0, 0, 0, 0, 1, 'p'}),
		"Origin without its name's end":   xlogFrame([]byte{'O', 0, 0, 0, 0, 0, 0, 0, 1, 'x'}),
		"unknown message kind":            xlogFrame([]byte{'Z', 1, 2, 3}),
		"keepalive cut short":             {Data: []byte{pglogrepl.PrimaryKeepaliveMessageByteID, 0, 0}},
	}
}

// TestMalformedFrameIsAnError: a malformed replication frame is a
// MalformedFrameError that says what was read (the kind, its size, the WAL
// position), never a panic in the reader goroutine nor an allocation of the
// lengths it declares (issue 46 item 3).
func TestMalformedFrameIsAnError(t *testing.T) {
	t.Parallel()
	for name, frame := range malformedFrames() {
		t.Run(name, func(t *testing.T) {
			var r received
			func() {
				defer func() {
					if p := recover(); p != nil {
						t.Fatalf("parse panicked: %v", p)
					}
				}()
				r = parse(frame)
			}()
			var mf *MalformedFrameError
			if !errors.As(r.err, &mf) {
				t.Fatalf("got %+v, want a MalformedFrameError", r)
			}
			if r.lm != nil || r.ka != nil {
				t.Fatalf("a message came with the error: %+v", r)
			}
			msg := r.err.Error()
			if !strings.Contains(msg, "malformed replication frame") || !strings.Contains(msg, "new one starts") {
				t.Fatalf("the error does not say what happened: %s", msg)
			}
			if len(frame.Data) > 25 && !strings.Contains(msg, "0/16B3748") {
				t.Fatalf("the error does not name the WAL position: %s", msg)
			}
		})
	}
}

// TestMalformedFrameAllocatesLittle: a frame declaring 4 GiB for a column,
// or 65535 columns, allocates nothing of the kind before its length or
// count is checked against the bytes that follow.
func TestMalformedFrameAllocatesLittle(t *testing.T) {
	frames := malformedFrames()
	for _, name := range []string{"Insert declaring a 4 GiB value", "Insert declaring 65535 columns", "Relation declaring 65535 cols", "Truncate declaring 4G relations", "Message declaring 4 GiB"} {
		var before, after runtimeMem
		before.read()
		for range 100 {
			_ = parse(frames[name])
		}
		after.read()
		// Each parse copies the frame (tens of bytes); what the frame
		// declares is 3 MB (65535 columns) to 16 GiB per parse.
		if grew := after.total - before.total; grew > 8<<20 {
			t.Errorf("%s: 100 parses allocated %d bytes", name, grew)
		}
	}
}

// TestDecodeAgreesWithPglogrepl: the bounds-checked decoders read what
// pglogrepl.Parse reads from well-formed messages.
func TestDecodeAgreesWithPglogrepl(t *testing.T) {
	t.Parallel()
	upd := tupleMsg(append([]byte{'U', 0, 0, 0x40, 0x01, 'O'}, append(tupleMsg(nil, "a", ""), 'N')...), "b", "c")
	begin := binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64([]byte{'B'}, 0x16B3748), 7), 42)
	commit := binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64([]byte{'C', 0}, 1), 2), 3)
	for _, msg := range [][]byte{
		relationMsg("id", "topic", "payload"), relationMsg(),
		tupleMsg([]byte{'I', 0, 0, 0x40, 0x01, 'N'}, "x", "yy"),
		tupleMsg([]byte{'U', 0, 0, 0x40, 0x01, 'N'}, "x"), upd,
		tupleMsg([]byte{'D', 0, 0, 0x40, 0x01, 'K'}, "k"),
		begin, commit,
		{'T', 0, 0, 0, 2, 1, 0, 0, 0, 5, 0, 0, 0, 6},
		binary.BigEndian.AppendUint32(append([]byte{'M', 1, 0, 0, 0, 0, 0, 0, 0, 1}, "p\x00"...), 0),
	} {
		checkAgainstPglogrepl(t, msg)
	}
}

// checkAgainstPglogrepl fails when decodeLogical accepts msg and pglogrepl
// panics on it or reads something else.
func checkAgainstPglogrepl(t *testing.T, msg []byte) {
	t.Helper()
	got, err := decodeLogical(msg)
	if err != nil {
		if len(msg) > 0 && strings.ContainsRune("RIUDBCTM", rune(msg[0])) && t.Name() == "TestDecodeAgreesWithPglogrepl" {
			t.Fatalf("decodeLogical(%q): %v", msg, err)
		}
		return
	}
	var want pglogrepl.Message
	func() {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("panic: %v", p)
			}
		}()
		want, err = pglogrepl.Parse(msg)
	}()
	if err != nil && strings.HasPrefix(err.Error(), "panic") {
		t.Fatalf("decodeLogical accepted %q, pglogrepl.Parse: %v", msg, err)
	}
	if err != nil {
		return // pglogrepl is stricter on a few lengths (an Insert of no column)
	}
	if !reflect.DeepEqual(normal(got), normal(want)) {
		t.Fatalf("decodeLogical(%q)\n = %#v\nwant %#v", msg, normal(got), normal(want))
	}
}

// normal makes a decoded message comparable: empty and nil slices alike.
func normal(m pglogrepl.Message) string {
	s := fmt.Sprintf("%T %+v", m, m)
	switch v := m.(type) {
	case *pglogrepl.RelationMessage:
		s = fmt.Sprintf("R%d %q.%q %c %d cols=%d", v.RelationID, v.Namespace, v.RelationName, v.ReplicaIdentity, v.ColumnNum, len(v.Columns))
		for _, c := range v.Columns {
			s += fmt.Sprintf(" %+v", *c)
		}
	case *pglogrepl.InsertMessage:
		s = fmt.Sprintf("R%d %s", v.RelationID, tupleString(v.Tuple))
	case *pglogrepl.UpdateMessage:
		s = fmt.Sprintf("R%d %c %s %s", v.RelationID, v.OldTupleType, tupleString(v.OldTuple), tupleString(v.NewTuple))
	case *pglogrepl.DeleteMessage:
		s = fmt.Sprintf("R%d %c %s", v.RelationID, v.OldTupleType, tupleString(v.OldTuple))
	}
	return s
}

func tupleString(t *pglogrepl.TupleData) string {
	if t == nil {
		return "<nil>"
	}
	s := fmt.Sprintf("%d:", t.ColumnNum)
	for _, c := range t.Columns {
		s += fmt.Sprintf(" %c/%d/%q", c.DataType, c.Length, c.Data)
	}
	return s
}

// FuzzPgoutputDecoding asserts that decoding a replication frame never
// panics and never allocates what the frame declares before checking it
// (a frame is at most as long as its input), and that a message the
// bounds-checked decoders accept is one pglogrepl.Parse reads the same way
// (or refuses: it is stricter on a few lengths), without a panic.
// Its seed corpus holds the malformed frames of issue 46 and well-formed
// messages of every kind the relay reads.
func FuzzPgoutputDecoding(f *testing.F) {
	for _, fr := range malformedFrames() {
		f.Add(fr.Data)
	}
	f.Add(xlogFrame(relationMsg("id", "topic")).Data)
	f.Add(xlogFrame(tupleMsg([]byte{'I', 0, 0, 0x40, 0x01, 'N'}, "x", "yy")).Data)
	f.Add(xlogFrame(tupleMsg(append([]byte{'U', 0, 0, 0x40, 0x01, 'K'}, append(tupleMsg(nil, "a"), 'N')...), "b")).Data)
	f.Add(xlogFrame([]byte{'T', 0, 0, 0, 1, 0, 0, 0, 0, 5}).Data)
	f.Fuzz(func(t *testing.T, data []byte) {
		r := parse(&pgproto3.CopyData{Data: data})
		if r.err != nil {
			var mf *MalformedFrameError
			if !errors.As(r.err, &mf) {
				t.Fatalf("an error that is not a MalformedFrameError: %v", r.err)
			}
			return
		}
		if len(data) > 25 && data[0] == pglogrepl.XLogDataByteID {
			checkAgainstPglogrepl(t, data[25:])
		}
	})
}

type runtimeMem struct{ total uint64 }

func (m *runtimeMem) read() {
	var s runtime.MemStats
	runtime.ReadMemStats(&s)
	m.total = s.TotalAlloc
}
