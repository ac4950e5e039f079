//! `window(ts, size)`: the tumbling event-time window of a timestamp, as a
//! struct `{start, end}` (Spark SQL's function and shape); and
//! `sliding_windows(ts, size, slide)`: the list of the sliding windows a
//! timestamp falls in, which a query's `GROUP BY window(ts, size, slide)`
//! is rewritten to unnest (`lakestream_job::window`); and
//! `session_window(ts, gap)`, a lone event's session, which the stateful
//! aggregation merges with the group's other sessions it overlaps.
//!
//! Windows are aligned to the Unix epoch: `window(ts, '1 minute')` of
//! 12:00:59.9 is `{start: 12:00:00, end: 12:01:00}`; `start` is inclusive,
//! `end` exclusive. Sliding windows start every `slide`: 12:07 is in the
//! 10-minute windows starting every 5 minutes at 12:00 and 12:05. A NULL
//! timestamp has a NULL window (no window).

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, PrimitiveArray, StructArray};
use arrow::datatypes::{
    DataType, Field, Fields, TimeUnit, TimestampMicrosecondType, TimestampMillisecondType,
    TimestampNanosecondType, TimestampSecondType,
};
use datafusion::common::{DataFusionError, Result as DfResult, ScalarValue, plan_err};
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};

/// The `window` function (see the module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct WindowFunction {
    signature: Signature,
}

impl WindowFunction {
    /// The function, ready to register.
    pub(crate) fn udf() -> ScalarUDF {
        ScalarUDF::new_from_impl(Self {
            signature: Signature::user_defined(Volatility::Immutable),
        })
    }
}

/// The struct type of a window over timestamps of `unit` and `tz`.
pub(crate) fn window_type(unit: TimeUnit, tz: Option<Arc<str>>) -> DataType {
    let ts = DataType::Timestamp(unit, tz);
    DataType::Struct(Fields::from(vec![
        Field::new("start", ts.clone(), true),
        Field::new("end", ts, true),
    ]))
}

/// How many `unit`s a window of `size` spans.
pub(crate) fn size_in(unit: TimeUnit, size: std::time::Duration) -> Option<i64> {
    let n = match unit {
        TimeUnit::Second => size.as_secs() as u128,
        TimeUnit::Millisecond => size.as_millis(),
        TimeUnit::Microsecond => size.as_micros(),
        TimeUnit::Nanosecond => size.as_nanos(),
    };
    i64::try_from(n).ok().filter(|&n| n > 0)
}

/// Milliseconds as a count of `unit`, rounded down.
pub(crate) fn ms_in(unit: TimeUnit, ms: i64) -> i64 {
    match unit {
        TimeUnit::Second => ms.div_euclid(1000),
        TimeUnit::Millisecond => ms,
        TimeUnit::Microsecond => ms.saturating_mul(1000),
        TimeUnit::Nanosecond => ms.saturating_mul(1_000_000),
    }
}

/// A count of `unit` as milliseconds, rounded down.
pub(crate) fn in_ms(unit: TimeUnit, v: i64) -> i64 {
    match unit {
        TimeUnit::Second => v.saturating_mul(1000),
        TimeUnit::Millisecond => v,
        TimeUnit::Microsecond => v.div_euclid(1000),
        TimeUnit::Nanosecond => v.div_euclid(1_000_000),
    }
}

fn duration_arg(v: &ColumnarValue, what: &str) -> DfResult<std::time::Duration> {
    let text = match v {
        ColumnarValue::Scalar(ScalarValue::Utf8(Some(s)))
        | ColumnarValue::Scalar(ScalarValue::Utf8View(Some(s)))
        | ColumnarValue::Scalar(ScalarValue::LargeUtf8(Some(s))) => s,
        _ => {
            return plan_err!(
                "window(): the {what} must be a constant such as '1 minute' or '30 seconds'"
            );
        }
    };
    lakestream_job::parse_duration(text).ok_or_else(|| {
        DataFusionError::Plan(format!(
            "window(): {text:?} is not a duration; use '1 minute', '30 seconds', '1 hour', '1 day'"
        ))
    })
}

impl ScalarUDFImpl for WindowFunction {
    fn name(&self) -> &str {
        "window"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> DfResult<Vec<DataType>> {
        if !(2..=3).contains(&arg_types.len()) {
            return plan_err!(
                "window() takes a timestamp, a size and optionally a slide: \
                 window(ts, '1 minute'), or window(ts, '10 minutes', '5 minutes') for sliding \
                 windows"
            );
        }
        let ts = match &arg_types[0] {
            t @ DataType::Timestamp(_, _) => t.clone(),
            DataType::Date32 | DataType::Date64 | DataType::Utf8 | DataType::Utf8View => {
                DataType::Timestamp(TimeUnit::Nanosecond, None)
            }
            other => {
                return plan_err!("window(): the first argument must be a timestamp, not {other}");
            }
        };
        let mut out = vec![ts];
        out.extend(std::iter::repeat_n(DataType::Utf8, arg_types.len() - 1));
        Ok(out)
    }

    fn return_type(&self, arg_types: &[DataType]) -> DfResult<DataType> {
        match &arg_types[0] {
            DataType::Timestamp(unit, tz) => Ok(window_type(*unit, tz.clone())),
            other => plan_err!("window(): the first argument must be a timestamp, not {other}"),
        }
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> DfResult<ColumnarValue> {
        let size = duration_arg(&args.args[1], "window size")?;
        if let Some(slide) = args.args.get(2) {
            let slide = duration_arg(slide, "slide")?;
            if slide != size {
                return plan_err!(
                    "window(ts, size, slide): sliding windows are supported in the GROUP BY of \
                     a query reading one table (no join); use a tumbling window, \
                     window(ts, size), here"
                );
            }
        }
        let DataType::Timestamp(unit, tz) = args.args[0].data_type() else {
            return plan_err!("window(): the first argument must be a timestamp");
        };
        let Some(n) = size_in(unit, size) else {
            return plan_err!("window(): the window size must be positive and at most a year");
        };
        let ts = args.args[0].to_array(args.number_rows)?;
        let (start, end) = match unit {
            TimeUnit::Second => bounds::<TimestampSecondType>(&ts, n, tz.clone()),
            TimeUnit::Millisecond => bounds::<TimestampMillisecondType>(&ts, n, tz.clone()),
            TimeUnit::Microsecond => bounds::<TimestampMicrosecondType>(&ts, n, tz.clone()),
            TimeUnit::Nanosecond => bounds::<TimestampNanosecondType>(&ts, n, tz.clone()),
        };
        let DataType::Struct(fields) = window_type(unit, tz) else {
            unreachable!("window_type is a struct")
        };
        let nulls = ts.nulls().cloned();
        Ok(ColumnarValue::Array(Arc::new(StructArray::try_new(
            fields,
            vec![start, end],
            nulls,
        )?)))
    }
}

/// The `sliding_windows` function (see the module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct SlidingWindowsFunction {
    signature: Signature,
}

impl SlidingWindowsFunction {
    /// The function, ready to register.
    pub(crate) fn udf() -> ScalarUDF {
        ScalarUDF::new_from_impl(Self {
            signature: Signature::user_defined(Volatility::Immutable),
        })
    }
}

impl ScalarUDFImpl for SlidingWindowsFunction {
    fn name(&self) -> &str {
        "sliding_windows"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> DfResult<Vec<DataType>> {
        if arg_types.len() != 3 {
            return plan_err!("sliding_windows(ts, size, slide) takes three arguments");
        }
        WindowFunction::udf().inner().coerce_types(arg_types)
    }

    fn return_type(&self, arg_types: &[DataType]) -> DfResult<DataType> {
        match &arg_types[0] {
            DataType::Timestamp(unit, tz) => Ok(DataType::List(Arc::new(Field::new(
                "item",
                window_type(*unit, tz.clone()),
                true,
            )))),
            other => plan_err!("window(): the first argument must be a timestamp, not {other}"),
        }
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> DfResult<ColumnarValue> {
        let size = duration_arg(&args.args[1], "window size")?;
        let slide = duration_arg(&args.args[2], "slide")?;
        let DataType::Timestamp(unit, tz) = args.args[0].data_type() else {
            return plan_err!("window(): the first argument must be a timestamp");
        };
        let (Some(n), Some(s)) = (size_in(unit, size), size_in(unit, slide)) else {
            return plan_err!("window(): sizes and slides must be positive and at most a year");
        };
        if s > n {
            return plan_err!(
                "window(ts, size, slide): the slide ({slide:?}) must not be longer than the \
                 window ({size:?}), or some rows would be in no window"
            );
        }
        let ts = args.args[0].to_array(args.number_rows)?;
        let ts = arrow::compute::cast(&ts, &DataType::Int64)?;
        let ts = ts.as_primitive::<arrow::datatypes::Int64Type>();
        let mut offsets = vec![0i32];
        let (mut starts, mut ends) = (Vec::new(), Vec::new());
        for v in ts.iter() {
            if let Some(v) = v {
                let last = v - v.rem_euclid(s);
                let mut first = last;
                while first - s + n > v {
                    first -= s;
                }
                let mut start = first;
                while start <= last {
                    starts.push(start);
                    ends.push(start.saturating_add(n));
                    start += s;
                }
            }
            offsets.push(i32::try_from(starts.len()).map_err(|_| {
                DataFusionError::Execution(
                    "sliding_windows(): too many windows in one batch".into(),
                )
            })?);
        }
        let typed = |v: Vec<i64>| -> DfResult<ArrayRef> {
            let a: ArrayRef = Arc::new(arrow::array::Int64Array::from(v));
            Ok(arrow::compute::cast(
                &a,
                &DataType::Timestamp(unit, tz.clone()),
            )?)
        };
        let DataType::Struct(fields) = window_type(unit, tz.clone()) else {
            unreachable!("window_type is a struct")
        };
        let windows = StructArray::try_new(fields, vec![typed(starts)?, typed(ends)?], None)?;
        let list = arrow::array::ListArray::try_new(
            Arc::new(Field::new("item", window_type(unit, tz), true)),
            arrow::buffer::OffsetBuffer::new(offsets.into()),
            Arc::new(windows),
            ts.nulls().cloned(),
        )?;
        Ok(ColumnarValue::Array(Arc::new(list)))
    }
}

/// The `session_window` function: `session_window(ts, gap)` is the
/// session a lone event at `ts` opens, `{start: ts, end: ts + gap}`; the
/// stateful aggregation merges the sessions of a group that overlap (events
/// less than `gap` apart) into one.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct SessionWindowFunction {
    signature: Signature,
}

impl SessionWindowFunction {
    /// The function, ready to register.
    pub(crate) fn udf() -> ScalarUDF {
        ScalarUDF::new_from_impl(Self {
            signature: Signature::user_defined(Volatility::Immutable),
        })
    }
}

impl ScalarUDFImpl for SessionWindowFunction {
    fn name(&self) -> &str {
        "session_window"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> DfResult<Vec<DataType>> {
        if arg_types.len() != 2 {
            return plan_err!(
                "session_window() takes a timestamp and a gap: session_window(ts, '5 minutes')"
            );
        }
        WindowFunction::udf().inner().coerce_types(arg_types)
    }

    fn return_type(&self, arg_types: &[DataType]) -> DfResult<DataType> {
        match &arg_types[0] {
            DataType::Timestamp(unit, tz) => Ok(window_type(*unit, tz.clone())),
            other => {
                plan_err!("session_window(): the first argument must be a timestamp, not {other}")
            }
        }
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> DfResult<ColumnarValue> {
        let gap = duration_arg(&args.args[1], "session gap")?;
        let DataType::Timestamp(unit, tz) = args.args[0].data_type() else {
            return plan_err!("session_window(): the first argument must be a timestamp");
        };
        let Some(n) = size_in(unit, gap) else {
            return plan_err!("session_window(): the gap must be positive and at most a year");
        };
        let ts = args.args[0].to_array(args.number_rows)?;
        let as_ts = |a: ArrayRef| arrow::compute::cast(&a, &DataType::Timestamp(unit, tz.clone()));
        let ints = arrow::compute::cast(&ts, &DataType::Int64)?;
        let ends: arrow::array::Int64Array = ints
            .as_primitive::<arrow::datatypes::Int64Type>()
            .unary(|v| v.saturating_add(n));
        let DataType::Struct(fields) = window_type(unit, tz.clone()) else {
            unreachable!("window_type is a struct")
        };
        let nulls = ts.nulls().cloned();
        Ok(ColumnarValue::Array(Arc::new(StructArray::try_new(
            fields,
            vec![as_ts(ints)?, as_ts(Arc::new(ends))?],
            nulls,
        )?)))
    }
}

fn bounds<T>(ts: &ArrayRef, n: i64, tz: Option<Arc<str>>) -> (ArrayRef, ArrayRef)
where
    T: arrow::datatypes::ArrowTimestampType,
{
    let ts: &PrimitiveArray<T> = ts.as_primitive();
    let start: PrimitiveArray<T> = ts.unary(|v| v - v.rem_euclid(n));
    let end: PrimitiveArray<T> = start.unary(|v| v.saturating_add(n));
    (
        Arc::new(start.with_timezone_opt(tz.clone())),
        Arc::new(end.with_timezone_opt(tz)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::prelude::SessionContext;

    #[tokio::test]
    async fn windows_are_epoch_aligned_with_exclusive_ends() {
        let ctx = SessionContext::new();
        ctx.register_udf(WindowFunction::udf());
        let df = ctx
            .sql(
                "SELECT CAST(get_field(w, 'start') AS VARCHAR) AS s, \
                 CAST(get_field(w, 'end') AS VARCHAR) AS e FROM \
                 (SELECT window(CAST(t AS TIMESTAMP), '1 minute') AS w FROM (VALUES \
                 ('2026-01-01T12:00:59.999'), ('2026-01-01T12:01:00'), (NULL)) AS v(t))",
            )
            .await
            .unwrap();
        let batches = df.collect().await.unwrap();
        let b = &batches[0];
        let text = |i: usize| arrow::compute::cast(b.column(i), &DataType::Utf8).unwrap();
        let (s, e) = (text(0), text(1));
        let (s, e) = (s.as_string::<i32>(), e.as_string::<i32>());
        assert_eq!(s.value(0), "2026-01-01T12:00:00");
        assert_eq!(e.value(0), "2026-01-01T12:01:00");
        assert_eq!(s.value(1), "2026-01-01T12:01:00");
        assert!(s.is_null(2));
    }

    #[tokio::test]
    async fn a_timestamp_is_in_every_sliding_window_that_covers_it() {
        let ctx = SessionContext::new();
        ctx.register_udf(SlidingWindowsFunction::udf());
        let df = ctx
            .sql(
                "SELECT CAST(get_field(w, 'start') AS VARCHAR) AS s FROM (SELECT \
                 unnest(sliding_windows(CAST(t AS TIMESTAMP), '10 minutes', '5 minutes')) AS w \
                 FROM (VALUES ('2026-01-01T12:07:00'), ('2026-01-01T12:10:00'), (NULL)) AS v(t))",
            )
            .await
            .unwrap();
        let batches = df.collect().await.unwrap();
        let mut starts = Vec::new();
        for b in &batches {
            let s = arrow::compute::cast(b.column(0), &DataType::Utf8).unwrap();
            starts.extend(s.as_string::<i32>().iter().map(|v| v.unwrap().to_string()));
        }
        assert_eq!(
            starts,
            [
                "2026-01-01T12:00:00",
                "2026-01-01T12:05:00",
                "2026-01-01T12:05:00",
                "2026-01-01T12:10:00"
            ]
        );
    }

    #[tokio::test]
    async fn sliding_windows_and_bad_sizes_are_refused() {
        let ctx = SessionContext::new();
        ctx.register_udf(WindowFunction::udf());
        ctx.register_udf(SlidingWindowsFunction::udf());
        for (sql, msg) in [
            (
                "SELECT window(now(), '10 minutes', '5 minutes')",
                "sliding windows are supported in the GROUP BY",
            ),
            (
                "SELECT sliding_windows(now(), '5 minutes', '10 minutes')",
                "must not be longer than the window",
            ),
            ("SELECT window(now(), 'soon')", "is not a duration"),
            ("SELECT window(1, '1 minute')", "must be a timestamp"),
        ] {
            let err = match ctx.sql(sql).await {
                Ok(df) => df.collect().await.unwrap_err(),
                Err(e) => e,
            };
            assert!(err.to_string().contains(msg), "{sql}: {err}");
        }
    }
}
