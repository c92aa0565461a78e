package keyed

// Waiters are the keys that are ready to deliver and wait for a slot, in
// the order they started waiting; a key waits once however often it is
// added. The zero value is ready to use; it is not safe for concurrent use
// (its owner's loop or lock guards it).
type Waiters struct {
	keys []string
	in   map[string]struct{}
}

// Add makes key wait, unless it waits already.
func (w *Waiters) Add(key string) {
	if _, ok := w.in[key]; ok {
		return
	}
	if w.in == nil {
		w.in = map[string]struct{}{}
	}
	w.in[key] = struct{}{}
	w.keys = append(w.keys, key)
}

// Pop takes the key that has waited longest; ok is false when none waits.
func (w *Waiters) Pop() (key string, ok bool) {
	if len(w.keys) == 0 {
		return "", false
	}
	key = w.keys[0]
	w.keys[0] = ""
	w.keys = w.keys[1:]
	if len(w.keys) == 0 {
		w.keys = nil // let the array go
	}
	delete(w.in, key)
	return key, true
}
