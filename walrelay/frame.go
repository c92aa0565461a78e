package walrelay

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/jackc/pglogrepl"
)

// MalformedFrameError is the error that ends a replication session whose
// stream sent a frame the relay cannot decode: a message cut short, a
// declared length or count past the bytes that follow, an unknown kind. The
// relay logs it, counts it (outbox_wal_malformed_frames_total) and starts a
// new session, as after any other stream error; the slot resends from the
// last confirmed position.
type MalformedFrameError struct {
	// WALStart is the frame's WAL position; zero when the frame's header
	// itself could not be read.
	WALStart pglogrepl.LSN
	// Kind is the message's type byte (0 when there was none).
	Kind byte
	// Size is the message's length in bytes.
	Size int
	// Reason says what was wrong.
	Reason string
}

func (e *MalformedFrameError) Error() string {
	kind := "no message"
	if e.Kind != 0 {
		kind = fmt.Sprintf("a %q message of %d bytes", e.Kind, e.Size)
	}
	return fmt.Sprintf("walrelay: malformed replication frame at WAL %s (%s): %s; the session ends and a new one starts from the confirmed position (check the server and the network path: a non-TLS connection can be tampered with)", e.WALStart, kind, e.Reason)
}

// countMalformed counts a session that ended on a malformed frame.
func (s *Subscriber) countMalformed(err error) {
	var mf *MalformedFrameError
	if errors.As(err, &mf) {
		s.malformed.Add(1)
	}
}

// decodeKeepalive decodes a primary keepalive message (after its 'k').
func decodeKeepalive(src []byte) (*pglogrepl.PrimaryKeepaliveMessage, error) {
	ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(src)
	if err != nil {
		return nil, &MalformedFrameError{Kind: pglogrepl.PrimaryKeepaliveMessageByteID, Size: len(src), Reason: err.Error()}
	}
	return &ka, nil
}

// decodeXLogData decodes an XLogData frame (after its 'w') and the logical
// replication message it carries. The message keeps slices of a copy of
// src, which is valid only until the next receive. Every length and count
// the frame declares is checked against the bytes that follow before
// anything is read or allocated.
func decodeXLogData(src []byte) (pglogrepl.Message, error) {
	if len(src) < 24 {
		return nil, &MalformedFrameError{Kind: pglogrepl.XLogDataByteID, Size: len(src), Reason: fmt.Sprintf("an XLogData header needs 24 bytes, the frame has %d", len(src))}
	}
	xld, err := pglogrepl.ParseXLogData(append([]byte(nil), src...))
	if err != nil {
		return nil, &MalformedFrameError{Kind: pglogrepl.XLogDataByteID, Size: len(src), Reason: err.Error()}
	}
	m, err := decodeLogical(xld.WALData)
	if err != nil {
		var kind byte
		if len(xld.WALData) > 0 {
			kind = xld.WALData[0]
		}
		return nil, &MalformedFrameError{WALStart: xld.WALStart, Kind: kind, Size: len(xld.WALData), Reason: err.Error()}
	}
	return m, nil
}

// decodeLogical decodes one pgoutput message (proto_version 1).
func decodeLogical(src []byte) (pglogrepl.Message, error) {
	if len(src) == 0 {
		return nil, errors.New("an empty logical replication message")
	}
	body := src[1:]
	switch pglogrepl.MessageType(src[0]) {
	case pglogrepl.MessageTypeInsert:
		return decodeInsert(src)
	case pglogrepl.MessageTypeRelation:
		return decodeRelation(body)
	case pglogrepl.MessageTypeUpdate:
		return decodeUpdate(body)
	case pglogrepl.MessageTypeDelete:
		return decodeDelete(body)
	case pglogrepl.MessageTypeTruncate:
		// relation count (4), options (1), relation ids (4 each)
		if len(body) < 5 {
			return nil, fmt.Errorf("a Truncate message needs 5 bytes after its kind, has %d", len(body))
		}
		if n := int64(binary.BigEndian.Uint32(body)); n*4 > int64(len(body)-5) {
			return nil, fmt.Errorf("a Truncate message declares %d relations in %d bytes", n, len(body)-5)
		}
	case pglogrepl.MessageTypeMessage:
		// flags (1), LSN (8), prefix (string), content length (4), content
		if len(body) < 9 {
			return nil, fmt.Errorf("a logical decoding message needs 9 bytes before its prefix, has %d", len(body))
		}
		end := bytes.IndexByte(body[9:], 0)
		if end < 0 {
			return nil, errors.New("a logical decoding message's prefix has no terminating NUL")
		}
		rest := body[9+end+1:]
		if len(rest) < 4 || int64(binary.BigEndian.Uint32(rest)) > int64(len(rest)-4) {
			return nil, errors.New("a logical decoding message's content length is past the bytes that follow")
		}
	case pglogrepl.MessageTypeBegin:
		if len(body) < 20 {
			return nil, fmt.Errorf("a Begin message has 20 bytes after its kind, this one %d", len(body))
		}
	case pglogrepl.MessageTypeCommit:
		if len(body) < 25 {
			return nil, fmt.Errorf("a Commit message has 25 bytes after its kind, this one %d", len(body))
		}
	case pglogrepl.MessageTypeOrigin:
		if len(body) < 9 || bytes.IndexByte(body[8:], 0) < 0 {
			return nil, errors.New("an Origin message needs an LSN and a NUL-terminated name")
		}
	case pglogrepl.MessageTypeType:
		if len(body) < 6 || bytes.Count(body[4:], []byte{0}) < 2 {
			return nil, errors.New("a Type message needs a type id and two NUL-terminated names")
		}
	default:
		return nil, fmt.Errorf("unknown message kind %q", src[0])
	}
	// The checks above leave nothing for pglogrepl's decoder to read past.
	return pglogrepl.Parse(src)
}

// reader reads a message front to back, each read checked against the
// bytes left; after the first failure every read is a no-op and err says
// what was cut short.
type reader struct {
	src  []byte
	off  int
	what string
	err  error
}

func (r *reader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%s: "+format+" (at byte %d of %d)", append(append([]any{r.what}, args...), r.off, len(r.src))...)
	}
}

func (r *reader) byte(field string) byte {
	if r.err != nil || r.off+1 > len(r.src) {
		r.fail("cut short before %s", field)
		return 0
	}
	b := r.src[r.off]
	r.off++
	return b
}

func (r *reader) uint16(field string) uint16 {
	if r.err != nil || r.off+2 > len(r.src) {
		r.fail("cut short before %s", field)
		return 0
	}
	v := binary.BigEndian.Uint16(r.src[r.off:])
	r.off += 2
	return v
}

func (r *reader) uint32(field string) uint32 {
	if r.err != nil || r.off+4 > len(r.src) {
		r.fail("cut short before %s", field)
		return 0
	}
	v := binary.BigEndian.Uint32(r.src[r.off:])
	r.off += 4
	return v
}

func (r *reader) string(field string) string {
	if r.err != nil {
		return ""
	}
	end := bytes.IndexByte(r.src[r.off:], 0)
	if end < 0 {
		r.fail("%s has no terminating NUL", field)
		return ""
	}
	s := string(r.src[r.off : r.off+end])
	r.off += end + 1
	return s
}

// count reads a uint16 count of items that take at least minSize bytes
// each and refuses one the bytes left cannot hold, before the caller
// allocates for it.
func (r *reader) count(field string, minSize int) int {
	n := int(r.uint16(field))
	if r.err == nil && n*minSize > len(r.src)-r.off {
		r.fail("%s declares %d, the %d bytes left hold at most %d", field, n, len(r.src)-r.off, (len(r.src)-r.off)/minSize)
		return 0
	}
	return n
}

// done returns the first failure. Bytes after the message are ignored, as
// pglogrepl does.
func (r *reader) done() error { return r.err }

// decodeRelation decodes a Relation message (after its 'R').
func decodeRelation(src []byte) (*pglogrepl.RelationMessage, error) {
	r := &reader{src: src, what: "Relation message"}
	m := &pglogrepl.RelationMessage{}
	m.RelationID = r.uint32("the relation id")
	m.Namespace = r.string("the namespace")
	m.RelationName = r.string("the relation name")
	m.ReplicaIdentity = r.byte("the replica identity")
	n := r.count("the column count", 10) // flags, name's NUL, type, typmod
	m.ColumnNum = uint16(n)              //nolint:gosec // read from a uint16
	m.Columns = make([]*pglogrepl.RelationMessageColumn, 0, n)
	for i := 0; i < n && r.err == nil; i++ {
		c := &pglogrepl.RelationMessageColumn{}
		c.Flags = r.byte(fmt.Sprintf("column %d of %d", i, n))
		c.Name = r.string(fmt.Sprintf("the name of column %d", i))
		c.DataType = r.uint32(fmt.Sprintf("the type of column %d", i))
		c.TypeModifier = int32(r.uint32(fmt.Sprintf("the type modifier of column %d", i))) //nolint:gosec // a signed field sent as 4 bytes
		m.Columns = append(m.Columns, c)
	}
	if err := r.done(); err != nil {
		return nil, err
	}
	m.SetType(pglogrepl.MessageTypeRelation)
	return m, nil
}

// tuple reads a TupleData: column count, then each column's kind and, for
// text and binary, its length and bytes (slices of src, which the caller
// owns).
func (r *reader) tuple(which string) *pglogrepl.TupleData {
	n := r.count("the column count of the "+which, 1)
	cols := make([]pglogrepl.TupleDataColumn, n)
	ptrs := make([]*pglogrepl.TupleDataColumn, n)
	for i := 0; i < n && r.err == nil; i++ {
		c := &cols[i]
		c.DataType = r.byte(fmt.Sprintf("column %d of %d of the %s", i, n, which))
		switch c.DataType {
		case pglogrepl.TupleDataTypeText, pglogrepl.TupleDataTypeBinary:
			c.Length = r.uint32(fmt.Sprintf("the length of column %d of the %s", i, which))
			if r.err == nil && int64(c.Length) > int64(len(r.src)-r.off) {
				r.fail("column %d of the %s declares %d bytes, %d are left", i, which, c.Length, len(r.src)-r.off)
			}
			if r.err == nil {
				end := r.off + int(c.Length)
				c.Data = r.src[r.off:end:end]
				r.off = end
			}
		case pglogrepl.TupleDataTypeNull, pglogrepl.TupleDataTypeToast:
		default:
			if r.err == nil {
				r.fail("column %d of the %s has kind %q", i, which, c.DataType)
			}
		}
		ptrs[i] = c
	}
	return &pglogrepl.TupleData{ColumnNum: uint16(n), Columns: ptrs} //nolint:gosec // read from a uint16
}

// decodeUpdate decodes an Update message (after its 'U').
func decodeUpdate(src []byte) (*pglogrepl.UpdateMessage, error) {
	r := &reader{src: src, what: "Update message"}
	m := &pglogrepl.UpdateMessage{}
	m.RelationID = r.uint32("the relation id")
	kind := r.byte("the tuple kind")
	switch kind {
	case pglogrepl.UpdateMessageTupleTypeKey, pglogrepl.UpdateMessageTupleTypeOld:
		m.OldTupleType = kind
		m.OldTuple = r.tuple("old tuple")
		if k := r.byte("the new tuple's kind"); r.err == nil && k != pglogrepl.UpdateMessageTupleTypeNew {
			r.fail("the new tuple has kind %q, not 'N'", k)
		}
		m.NewTuple = r.tuple("new tuple")
	case pglogrepl.UpdateMessageTupleTypeNew:
		m.NewTuple = r.tuple("new tuple")
	default:
		if r.err == nil {
			r.fail("tuple kind %q is none of K, O, N", kind)
		}
	}
	if err := r.done(); err != nil {
		return nil, err
	}
	m.SetType(pglogrepl.MessageTypeUpdate)
	return m, nil
}

// decodeDelete decodes a Delete message (after its 'D').
func decodeDelete(src []byte) (*pglogrepl.DeleteMessage, error) {
	r := &reader{src: src, what: "Delete message"}
	m := &pglogrepl.DeleteMessage{}
	m.RelationID = r.uint32("the relation id")
	m.OldTupleType = r.byte("the tuple kind")
	if r.err == nil && m.OldTupleType != pglogrepl.DeleteMessageTupleTypeKey && m.OldTupleType != pglogrepl.DeleteMessageTupleTypeOld {
		r.fail("tuple kind %q is neither K nor O", m.OldTupleType)
	}
	m.OldTuple = r.tuple("old tuple")
	if err := r.done(); err != nil {
		return nil, err
	}
	m.SetType(pglogrepl.MessageTypeDelete)
	return m, nil
}
