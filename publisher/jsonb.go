package publisher

import (
	"errors"
	"fmt"
	"unicode/utf8"
)

// PostgreSQL's numeric limits, which bound every JSONB number: a weight
// (position of the first non-zero digit group of 4 decimal digits) in an
// int16, and a display scale (digits after the decimal point, trailing
// zeros included) of at most 16383. A number past them is refused by the
// INSERT with SQLSTATE 22003, which aborts the caller's transaction.
const (
	numericMaxWeight   = 32767
	numericMinWeight   = -32768
	numericMaxDScale   = 16383
	numericMaxExponent = 1<<30 - 1 // INT_MAX/2: numeric_in refuses |exponent| from there on
)

// jsonbStorable reports, for a payload json.Valid accepted, what PostgreSQL's
// jsonb input would refuse: bytes that are not UTF-8, a string escape
// \u0000, a lone UTF-16 surrogate escape, or a number outside PostgreSQL's
// numeric range. The error never quotes the payload; it says where
// (the byte offset) and what to do.
func jsonbStorable(p []byte) error {
	if !utf8.Valid(p) {
		i := invalidUTF8At(p)
		return fmt.Errorf("not valid UTF-8 at byte %d; the column is JSONB, whose strings are UTF-8 (encode binary data as base64 or hex)", i)
	}
	for i := 0; i < len(p); {
		c := p[i]
		switch {
		case c == '"':
			n, err := jsonbString(p, i)
			if err != nil {
				return err
			}
			i = n
		case c == '-' || (c >= '0' && c <= '9'):
			n, err := jsonbNumber(p, i)
			if err != nil {
				return err
			}
			i = n
		default:
			i++
		}
	}
	return nil
}

// jsonbTextBytes bounds from above the length of PostgreSQL's text output of
// the JSONB value of p (valid JSON that jsonbStorable accepted), which is
// what the relay reads (payload::text) and publishes. That output drops the
// white space, writes ": " and ", " between members and elements, keeps or
// shortens strings (an escape \u00e9 becomes the character), and writes a
// number in full, without exponent (1e900 is 901 digits).
func jsonbTextBytes(p []byte) int {
	n := 0
	for i := 0; i < len(p); {
		c := p[i]
		switch {
		case c == '"':
			end, err := jsonbString(p, i)
			if err != nil {
				return len(p) // not reached for a valid payload
			}
			n += end - i
			i = end
		case c == '-' || (c >= '0' && c <= '9'):
			end, digits := numberTextBytes(p, i)
			n += digits
			i = end
		case c == ',' || c == ':':
			n += 2
			i++
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		default:
			n++
			i++
		}
	}
	return n
}

// numberTextBytes returns the end of the JSON number at p[i] and the length
// of PostgreSQL's numeric output of it at most: a sign, the digits before
// the point (at least one, leading zeros dropped) and, when the display scale is positive, the
// point and that many digits. jsonbNumber has checked the number's range.
func numberTextBytes(p []byte, i int) (end, size int) {
	n := scanNumber(p, i)
	if n.neg {
		size++
	}
	exp := n.exponent()
	// Digits before the point, leading zeros dropped: "0" for a zero.
	size++
	if n.firstNonZero >= 0 {
		size += max(0, n.intDigits+exp-n.firstNonZero-1)
	}
	if scale := n.fracDigits - exp; scale > 0 {
		size += 1 + scale
	}
	return n.end, size
}

// number is a JSON number as scanNumber reads it.
type number struct {
	neg                   bool
	intDigits, fracDigits int
	firstNonZero          int // index among the mantissa's digits, -1 for a zero
	expAbs                int // the exponent's magnitude, saturated at numericMaxExponent
	expNeg                bool
	end                   int // the offset after the number
}

// exponent is the number's signed exponent (saturated).
func (n number) exponent() int {
	if n.expNeg {
		return -n.expAbs
	}
	return n.expAbs
}

// scanNumber reads the JSON number starting at p[i] (outside any string):
// its sign, the digits of its mantissa before and after the point, and its
// exponent.
func scanNumber(p []byte, i int) number {
	n := number{firstNonZero: -1}
	if p[i] == '-' {
		n.neg = true
		i++
	}
	for ; i < len(p) && p[i] >= '0' && p[i] <= '9'; i++ {
		if n.firstNonZero < 0 && p[i] != '0' {
			n.firstNonZero = n.intDigits
		}
		n.intDigits++
	}
	if i < len(p) && p[i] == '.' {
		for i++; i < len(p) && p[i] >= '0' && p[i] <= '9'; i++ {
			if n.firstNonZero < 0 && p[i] != '0' {
				n.firstNonZero = n.intDigits + n.fracDigits
			}
			n.fracDigits++
		}
	}
	if i < len(p) && (p[i] == 'e' || p[i] == 'E') {
		i++
		if i < len(p) && (p[i] == '+' || p[i] == '-') {
			n.expNeg = p[i] == '-'
			i++
		}
		for ; i < len(p) && p[i] >= '0' && p[i] <= '9'; i++ {
			if n.expAbs < numericMaxExponent {
				n.expAbs = n.expAbs*10 + int(p[i]-'0')
			}
		}
	}
	n.end = i
	return n
}

func invalidUTF8At(p []byte) int {
	for i := 0; i < len(p); {
		r, n := utf8.DecodeRune(p[i:])
		if r == utf8.RuneError && n <= 1 {
			return i
		}
		i += n
	}
	return len(p)
}

// jsonbString checks the string starting at p[i] (a quote) and returns the
// offset after its closing quote.
func jsonbString(p []byte, i int) (int, error) {
	start := i
	i++
	for i < len(p) {
		switch p[i] {
		case '"':
			return i + 1, nil
		case '\\':
			if i+1 >= len(p) {
				return 0, errors.New("not valid JSON; the column is JSONB (marshal the event with encoding/json)")
			}
			if p[i+1] != 'u' {
				i += 2
				continue
			}
			r, ok := hex4(p, i+2)
			if !ok {
				return 0, errors.New("not valid JSON; the column is JSONB (marshal the event with encoding/json)")
			}
			switch {
			case r == 0:
				return 0, errors.New(`contains the escape \u0000, which PostgreSQL JSONB cannot store; remove NUL characters from strings`)
			case r >= 0xD800 && r <= 0xDBFF: // high surrogate: a low one must follow
				lo, ok := -1, false
				if i+7 < len(p) && p[i+6] == '\\' && p[i+7] == 'u' {
					lo, ok = hex4(p, i+8)
				}
				if !ok || lo < 0xDC00 || lo > 0xDFFF {
					return 0, fmt.Errorf(`the string at byte %d has a UTF-16 high surrogate escape (\uD800-\uDBFF) not followed by a low one, which PostgreSQL JSONB refuses; escape the pair or write the character as UTF-8`, start)
				}
				i += 12
			case r >= 0xDC00 && r <= 0xDFFF:
				return 0, fmt.Errorf(`the string at byte %d has a lone UTF-16 low surrogate escape (\uDC00-\uDFFF), which PostgreSQL JSONB refuses; escape the pair or write the character as UTF-8`, start)
			default:
				i += 6
			}
		default:
			i++
		}
	}
	return 0, errors.New("not valid JSON; the column is JSONB (marshal the event with encoding/json)")
}

func hex4(p []byte, i int) (int, bool) {
	if i+4 > len(p) {
		return 0, false
	}
	v := 0
	for _, c := range p[i : i+4] {
		switch {
		case c >= '0' && c <= '9':
			v = v<<4 | int(c-'0')
		case c >= 'a' && c <= 'f':
			v = v<<4 | int(c-'a'+10)
		case c >= 'A' && c <= 'F':
			v = v<<4 | int(c-'A'+10)
		default:
			return 0, false
		}
	}
	return v, true
}

// jsonbNumber checks the number starting at p[i] (outside any string)
// against PostgreSQL's numeric range, as numeric_in computes it, and
// returns the offset after it.
func jsonbNumber(p []byte, i int) (int, error) {
	start := i
	n := scanNumber(p, i)
	if n.expAbs >= numericMaxExponent {
		return 0, numberRangeError(start)
	}
	intDigits, fracDigits, firstNonZero, exp := n.intDigits, n.fracDigits, n.firstNonZero, n.exponent()
	// Display scale: the digits after the point, less the exponent.
	if fracDigits-exp > numericMaxDScale {
		return 0, numberRangeError(start)
	}
	if firstNonZero >= 0 {
		// Decimal weight of the first non-zero digit, then its group of 4.
		dw := intDigits - 1 - firstNonZero + exp
		w := dw / 4
		if dw < 0 && dw%4 != 0 {
			w--
		}
		if w > numericMaxWeight || w < numericMinWeight {
			return 0, numberRangeError(start)
		}
	}
	return n.end, nil
}

func numberRangeError(at int) error {
	return fmt.Errorf("the number at byte %d is outside PostgreSQL's numeric range (at most 131072 digits before the point and 16383 after it), which JSONB refuses; send it as a string", at)
}
